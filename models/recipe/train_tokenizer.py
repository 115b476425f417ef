"""Byte-level BPE tokenizer (vocab 4096) for the bundled models, trained on the train split only.

    python models/recipe/train_tokenizer.py --out models/strata-moe-tiny

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML chat template, eos = pad = ``<|endoftext|>``) so
that ``transformers.AutoTokenizer.from_pretrained(out)`` loads it. Byte-level pre-tokenization with no prefix
space and a byte-level decoder make ``decode(encode(text)) == text`` for any text, indentation included; the
script checks that on every held-out file before saving.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prepare_data import HELDOUT_LIST, REPO_ROOT, TRAIN_LIST, read_texts

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(texts: list[str]) -> Tokenizer:
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens ever
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def check_round_trip(tokenizer: Tokenizer, texts: list[str]) -> None:
    for text in texts + ["def f(x):\n\tif x:\n        return  x\n\n\n", "  \u00e9\u4e2d  \r\n"]:
        decoded = tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False)
        if decoded != text:
            raise ValueError(f"tokenizer does not round-trip: {text[:60]!r} -> {decoded[:60]!r}")


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "strata-moe-tiny")
    args = parser.parse_args()
    tokenizer = train(read_texts(TRAIN_LIST))
    check_round_trip(tokenizer, read_texts(HELDOUT_LIST))
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"vocab {tokenizer.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
