"""Chat templates render in Jinja's immutable sandbox (`engine.tokenizer`): a template that reaches for Python's
internals fails with `ChatTemplateError`, which the router answers as the request's INVALID_ARGUMENT."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from engine.tokenizer import ChatTemplateError, Tokenizer
from router.served_model import ServedModel
from router.validation import ApiError

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "strata-moe-tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",  # immutable: no mutation either
]


def tokenizer_with(template: str) -> Tokenizer:
    return replace(Tokenizer.from_dir(BUNDLED), chat_template=template)


def test_the_bundled_template_still_renders_in_the_sandbox():
    rendered = Tokenizer.from_dir(BUNDLED).apply_chat_template(MESSAGES)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", ESCAPES)
def test_template_reaching_for_internals_fails_with_a_clear_error(template):
    with pytest.raises(ChatTemplateError, match="stopped by the sandbox: access to attribute .* is unsafe"):
        tokenizer_with(template).apply_chat_template(MESSAGES)


def test_trim_blocks_and_raise_exception_work_as_in_hugging_face():
    tok = tokenizer_with("{% if messages %}\n  {{ messages[0]['content'] }}{% endif %}")
    assert tok.apply_chat_template(MESSAGES) == "  hi"
    with pytest.raises(ChatTemplateError, match="the chat template failed: roles must alternate"):
        tokenizer_with("{{ raise_exception('roles must alternate') }}").apply_chat_template(MESSAGES)


def test_router_turns_a_refused_template_into_invalid_argument_on_messages():
    model = ServedModel.load(str(BUNDLED))
    model = replace(model, tokenizer=tokenizer_with(ESCAPES[0]))
    with pytest.raises(ApiError) as info:
        model.render_chat(MESSAGES)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.param == "messages"
    assert "unsafe" in info.value.message
