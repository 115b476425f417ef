"""Incremental detokenization with a byte-level BPE tokenizer built here: UTF-8 split across tokens, stop strings."""
from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import Detokenizer, decode_final
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer as CheckpointTokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "strata-moe-tiny"

CORPUS = ["hello world, the quick brown fox", "stop here please", "naïve café déjà vu", "the end of it"] * 20
MULTIBYTE = "naïve café 日本語 🙂 déjà"


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> Tokenizer:
    """Byte-level BPE with a tiny vocabulary: CJK and emoji stay split into single-byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def stream(text: str, params: SamplingParams = SamplingParams(), prompt: str = "the ") -> tuple[list, Detokenizer]:
    tok = make_tokenizer()
    detok = Detokenizer(tok, tok.encode(prompt).ids, params)
    return [detok.push([t]) for t in tok.encode(text).ids], detok


def test_multibyte_characters_are_split_across_tokens():
    """Guards the test itself: some characters must need more than one token."""
    tok = make_tokenizer()
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode(MULTIBYTE).ids)


def test_incremental_text_equals_full_decode_and_never_has_partial_characters():
    steps, detok = stream(MULTIBYTE)
    deltas = [s.new_text for s in steps]
    assert "".join(deltas) == MULTIBYTE == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens completed no character


def test_emoji_is_released_whole_by_its_last_byte():
    tok = make_tokenizer()
    ids = tok.encode("a🙂").ids
    assert len(ids) == 5  # 'a' + the emoji's four bytes
    detok = Detokenizer(tok, tok.encode("x").ids, SamplingParams())
    assert [detok.push([t]).new_text for t in ids] == ["a", "", "", "", "🙂"]


def test_several_tokens_per_push():
    tok = make_tokenizer()
    ids = tok.encode(MULTIBYTE).ids
    detok = Detokenizer(tok, [], SamplingParams())
    text = "".join(detok.push(ids[i:i + 3]).new_text for i in range(0, len(ids), 3))
    assert text == MULTIBYTE


def test_stop_string_spanning_tokens_truncates_output():
    steps, detok = stream("hello world, the quick brown fox", SamplingParams(stop=("o w", "zzz")))
    stops = [s.stop for s in steps]
    first = stops.index("o w")
    assert all(s is None for s in stops[:first]) and all(s == "o w" for s in stops[first:])
    assert "".join(s.new_text for s in steps) == detok.text == "hell"


def test_stop_string_included_when_asked():
    params = SamplingParams(stop=("o w",), include_stop_str_in_output=True)
    steps, detok = stream("hello world, the quick brown fox", params)
    assert detok.text == "hello w"
    assert "".join(s.new_text for s in steps) == "hello w"


def test_earliest_stop_string_wins():
    _, detok = stream("the quick brown fox", SamplingParams(stop=("fox", "quick", "brown")))
    assert detok.text == "the " and detok.stop == "quick"


def test_possible_stop_prefix_is_held_back_then_flushed():
    steps, detok = stream("hello wor", SamplingParams(stop=("world",)))
    assert detok.text == "hello "           # 'wor' might still become 'world'
    assert detok.flush() == "wor"
    assert detok.text == "hello wor"


def test_multibyte_stop_string():
    steps, detok = stream(MULTIBYTE, SamplingParams(stop=("本語",)))
    assert detok.text == "naïve café 日" and steps[-1].stop == "本語"


def test_special_tokens_are_skipped():
    tok = make_tokenizer()
    eos = tok.token_to_id("<eos>")
    detok = Detokenizer(tok, [], SamplingParams())
    ids = tok.encode("the end").ids + [eos]
    assert "".join(detok.push([t]).new_text for t in ids) == "the end"


@pytest.mark.parametrize("prompt", ["", "日本", "hello"])
def test_prompt_context_does_not_leak_into_output(prompt):
    steps, detok = stream("déjà vu 🙂", prompt=prompt)
    assert detok.text == "déjà vu 🙂"


@functools.lru_cache(maxsize=1)
def make_metaspace_tokenizer() -> Tokenizer:
    """Llama-2's decoder chain (Metaspace pieces, byte fallback <0xNN> tokens, one leading space stripped)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    pieces = ["▁", "▁the", "▁a", "h", "e", "l", "o", "▁h", "he", "ll", "▁hello", "é", "日", "▁本", ".", "▁."]
    for piece in pieces:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def streamed_text(tok, prompt: list[int], outputs: list[int]) -> str:
    """What the engine streams: one push per step, flushed when the request ends."""
    detok = Detokenizer(tok, prompt, SamplingParams())
    return "".join(detok.push([t]).new_text for t in outputs) + detok.flush()


class CountingDecoder:
    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


PIECES = ["the", " hello", " naïve", " café", "日本語", "🙂", " déjà", " ", ".", " vu", "\n"]


def random_ids(rng: random.Random, tok, vocab: int) -> list[int]:
    """Real text (whole, or cut anywhere: maybe inside a character), or random ids (invalid UTF-8 byte runs,
    special tokens)."""
    if rng.random() < 0.3:
        return [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
    ids = tok.encode("".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))).ids
    return ids if rng.random() < 0.6 else ids[:rng.randint(0, len(ids))]


@pytest.mark.parametrize("name", ["byte-level", "metaspace", "bundled"])
def test_final_decode_equals_the_streamed_text(name):
    """A FINAL_ONLY request's final decode gives the text the steps would have streamed, including outputs that
    end inside a character, invalid byte runs and skipped special tokens; most texts take one decode."""
    if name == "bundled":
        checkpoint = CheckpointTokenizer.from_dir(BUNDLED)
        tok, vocab = checkpoint.backend, checkpoint.vocab_size
    else:
        tok = make_tokenizer() if name == "byte-level" else make_metaspace_tokenizer()
        vocab = tok.get_vocab_size()
    rng = random.Random(name)
    one_decode = 0
    for _ in range(400):
        prompt, outputs = random_ids(rng, tok, vocab)[-7:], random_ids(rng, tok, vocab)
        counting = CountingDecoder(tok)
        assert decode_final(counting, prompt, outputs) == streamed_text(tok, prompt, outputs), (prompt, outputs)
        one_decode += counting.calls == 2   # the prompt context and the whole text
    assert one_decode > 100


def test_final_decode_drops_a_trailing_partial_character_as_streaming_does():
    tok = make_tokenizer()
    ids = tok.encode("a日").ids
    assert decode_final(tok, [], ids[:-1]) == streamed_text(tok, [], ids[:-1]) == "a"
    assert decode_final(tok, [], ids) == "a日"
