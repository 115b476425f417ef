"""`Tokenizer`: a checkpoint's tokenizer.json (Hugging Face `tokenizers`) plus the special tokens and chat
template from tokenizer_config.json and generation_config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.models.errors import MissingFileError


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]       # any of these ends a generation
    add_bos_token: bool
    chat_template: str | None

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise MissingFileError(f"{path}: tokenizer.json is missing; a checkpoint folder needs one "
                                   f"(Hugging Face `tokenizers` format)")
        backend = HFTokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos else generation.get("bos_token_id")
        eos_ids = list(_as_ids(generation.get("eos_token_id")))
        eos_id = backend.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.insert(0, eos_id)
        return cls(backend, bos_id, tuple(eos_ids), bool(config.get("add_bos_token", False)),
                   config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (largest id + 1, added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The checkpoint's template rendered in a sandbox (a checkpoint's template is code from whoever published
        it). ChatTemplateError when it fails or reaches for what the sandbox forbids (`__class__`, `__globals__`,
        ...)."""
        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer_config.json has no chat_template; send a plain prompt")
        import jinja2

        tok = self.backend
        bos = tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            template = _sandbox().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                                   eos_token=eos)
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template was stopped by the sandbox: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None


class ChatTemplateError(ValueError):
    """A chat template that does not render: a syntax error, `raise_exception(...)`, or an unsafe operation."""


def _sandbox():
    """Jinja's immutable sandbox, as Hugging Face renders chat templates (with its `raise_exception`); an unsafe
    attribute fails at once, where Jinja's default would render it as an empty string."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class ChatSandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of a "
                                                  f"{type(obj).__name__!r} object is unsafe")

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env
