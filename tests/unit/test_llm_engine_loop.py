"""The engine loop against a deterministic stand-in runner with a real paged "KV cache" of token ids.

The stand-in writes each computed token into its slot and derives a position's logits from every token it reads
back through the block table, so a wrong block table, a bad prefix hit or a reused block changes the output:
comparing against each request run alone in a roomy engine checks paging, prefix caching, chunking and
preemption end to end.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import pytest

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.batch import StepBatch
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import RequestOutputKind, SamplingParams
from kvstore.hashing import Namespace, hash_block
from engine.config import CacheConfig, SchedulerConfig

BS = 4
ROOT = Namespace("toy", "bs4", "float32").fingerprint()


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "naïve café 日本語"] * 20, trainer)
    return tok


VOCAB = make_tokenizer().get_vocab_size()
EOS = make_tokenizer().token_to_id("<eos>")


def toy_logits(context: list[int]) -> torch.Tensor:
    seed = zlib.crc32(torch.tensor(context, dtype=torch.int64).numpy().tobytes())
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [vocab]
    logits[EOS] = -1e9  # only tests that want eos put it back
    return logits


class PagedToyRunner:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.slots: list[int | None] = [None] * (num_blocks * BS)
        self.num_steps = 0

    def execute(self, batch: StepBatch) -> torch.Tensor:
        self.num_steps += 1
        rows = []
        for seq in batch.seqs:
            def slot(pos: int) -> int:
                return seq.block_table[pos // BS] * BS + pos % BS
            for i, token_id in enumerate(seq.token_ids):
                self.slots[slot(seq.start_pos + i)] = token_id
            end = seq.start_pos + len(seq.token_ids)
            for pos in range(end - seq.num_logits, end):
                rows.append(toy_logits([self.slots[slot(p)] for p in range(pos + 1)]))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)  # [sum(num_logits), vocab]


def make_engine(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16, prefix_caching: bool = True,
                eos: tuple[int, ...] = (EOS,), **kw) -> LLMEngine:
    return LLMEngine(PagedToyRunner(num_blocks), make_tokenizer(),
                     CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=128),
                     hash_block, ROOT, eos, **kw)


def run_to_end(engine: LLMEngine) -> dict[str, list]:
    """All outputs per request id, in order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.block_manager.check_integrity()
    return outputs


SYSTEM = list(range(10, 30))  # a shared 20-token prefix (5 blocks)
PARAMS = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=10, temperature=1.0, seed=3),
          SamplingParams(max_tokens=14, temperature=0.8, top_k=20, seed=4),
          SamplingParams(max_tokens=9, temperature=1.2, top_p=0.9, seed=5)]


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"r{i}", SYSTEM[: 8 + (i % 3) * 6] + [40 + i] * (i % 5 + 1), PARAMS[i % 4]) for i in range(12)]


def alone(prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(prefix_caching=False)
    engine.add_request("x", prompt, params)
    return run_to_end(engine)["x"][-1].token_ids


def test_tokens_equal_running_alone_despite_chunking_prefix_hits_and_preemption():
    engine = make_engine(num_blocks=24, budget=16, max_num_seqs=8)
    requests = [engine.add_request(rid, prompt, params) for rid, prompt, params in workload()]
    outputs = run_to_end(engine)
    assert sum(r.num_preemptions for r in requests) > 0
    assert engine.prefix_cache_stats.hit_blocks > 0
    for rid, prompt, params in workload():
        final = outputs[rid][-1]
        assert final.finished and final.finish_reason == "length"
        assert final.token_ids == alone(prompt, params), rid
    assert engine.block_manager.num_free_blocks == 24


def test_outputs_stream_deltas_that_add_up():
    engine = make_engine()
    engine.add_request("a", "the quick brown", SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    outs = run_to_end(engine)["a"]
    assert [len(o.new_token_ids) for o in outs] == [1] * 8
    assert sum((o.new_token_ids for o in outs), []) == outs[-1].token_ids
    text = outs[-1].text
    assert "".join(o.new_text for o in outs) == text
    full = make_tokenizer().decode(outs[-1].token_ids)  # random bytes: a trailing partial character stays out
    assert full.startswith(text) and set(full[len(text):]) <= {"\ufffd"}
    assert [o.finished for o in outs] == [False] * 7 + [True]
    assert outs[-1].prompt_tokens == len(make_tokenizer().encode("the quick brown").ids)


def test_stop_string_spanning_tokens_finishes_with_stop():
    free_run = make_engine()
    free_run.add_request("a", list(range(50, 60)), SamplingParams(max_tokens=20))
    text = run_to_end(free_run)["a"][-1].text
    stop = text[6:9]
    engine = make_engine()
    engine.add_request("a", list(range(50, 60)), SamplingParams(max_tokens=20, stop=(stop,)))
    final = run_to_end(engine)["a"][-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:text.index(stop)]
    assert engine.block_manager.num_free_blocks == 64 and not engine.has_unfinished()


def test_eos_finishes_with_stop_unless_ignored():
    def first_token(prompt: list[int]) -> int:
        return int(toy_logits(prompt).argmax())
    prompt = [5, 6, 7]
    eos_engine = make_engine(eos=(first_token(prompt),))
    eos_engine.add_request("a", prompt, SamplingParams(max_tokens=5))
    eos_engine.add_request("b", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    outs = run_to_end(eos_engine)
    assert (outs["a"][-1].finish_reason, outs["a"][-1].stop_reason, len(outs["a"][-1].token_ids)) == (
        "stop", first_token(prompt), 1)
    assert (outs["b"][-1].finish_reason, len(outs["b"][-1].token_ids)) == ("length", 5)


def test_abort_mid_generation_frees_everything():
    engine = make_engine()
    engine.add_request("a", list(range(9)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(9)), SamplingParams(max_tokens=3))
    engine.step()
    engine.step()
    assert engine.abort("a") and not engine.abort("a")
    outs = run_to_end(engine)
    assert "a" not in outs and outs["b"][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 64


def test_second_turn_hits_the_prefix_cache_and_reports_it():
    engine = make_engine()
    engine.add_request("t1", list(range(13)), SamplingParams(max_tokens=6))
    first = run_to_end(engine)["t1"][-1]
    engine.add_request("t2", list(range(13)) + first.token_ids + [3, 4], SamplingParams(max_tokens=2))
    second = run_to_end(engine)["t2"][-1]
    assert second.num_cached_tokens == 16  # 13 prompt + 5 computed outputs -> 4 full blocks indexed


def test_block_hooks_report_stored_and_removed_blocks():
    stored, removed = [], []
    engine = make_engine(num_blocks=6, on_block_stored=lambda *e: stored.append(e), on_block_removed=removed.append)
    engine.add_request("a", list(range(9)), SamplingParams(max_tokens=4))
    run_to_end(engine)
    # 9 prompt + 3 computed outputs: three full blocks
    assert [(e[0], e[3][:4]) for e in stored[:2]] == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    assert [e[0] for e in stored] == [0, 1, 2] and stored[2][3][0] == 8
    assert stored[0][2] is None and stored[1][2] == stored[0][1] and stored[2][2] == stored[1][1]
    engine.add_request("b", list(range(100, 121)), SamplingParams(max_tokens=1))
    run_to_end(engine)                    # takes the 3 free blocks, then evicts a's blocks tail first
    assert removed == [stored[2][1], stored[1][1], stored[0][1]]


def test_generate_returns_final_outputs_in_prompt_order():
    engine = make_engine()
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=3))
    assert [o.finished for o in outs] == [True, True]
    assert outs[0].token_ids == alone([1, 2, 3], SamplingParams(max_tokens=3))
    assert engine.add_request("z", "x").status is RequestStatus.WAITING


class ListTokenizer:
    """The shape of engine.tokenizer.Tokenizer: encode() returns ids and it knows its eos ids."""

    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return make_tokenizer().encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return make_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


def test_tokenizer_returning_id_lists_and_default_eos():
    engine = LLMEngine(PagedToyRunner(16), ListTokenizer(), CacheConfig(block_size=BS, num_blocks=16),
                       SchedulerConfig(max_model_len=64), hash_block, ROOT)
    assert engine.scheduler.eos_token_ids == {EOS}
    request = engine.add_request("a", "the quick", SamplingParams(max_tokens=2))
    assert request.prompt_token_ids == make_tokenizer().encode("the quick").ids
    assert run_to_end(engine)["a"][-1].finish_reason == "length"


class CountingTokenizer(ListTokenizer):
    def __init__(self) -> None:
        self.decodes = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return super().decode(ids, skip_special_tokens)


def final_fields(out) -> tuple:
    return (out.token_ids, out.text, out.finished, out.finish_reason, out.stop_reason, out.logprobs,
            out.num_cached_tokens, out.prompt_tokens)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"stop": ("e",)}, {"repetition_penalty": 1.3, "min_tokens": 2}])
def test_final_only_gives_one_output_equal_to_the_streamed_end(extra):
    """The same requests streamed (CUMULATIVE) and FINAL_ONLY: one output each, with the streamed final fields, and
    its `new_*` fields holding everything."""
    def run(kind: RequestOutputKind) -> dict[str, list]:
        engine = make_engine()
        for i, (rid, prompt, params) in enumerate(workload()[:6]):
            engine.add_request(rid, "the quick brown fox"[:5 + i] if i % 2 else prompt,
                               dataclasses.replace(params, output_kind=kind, **extra))
        outputs = run_to_end(engine)
        assert engine.sampler.token_counts.num_slots == 0, "penalty counts are released when requests end"
        return outputs
    streamed, final = run(RequestOutputKind.CUMULATIVE), run(RequestOutputKind.FINAL_ONLY)
    assert streamed.keys() == final.keys()
    for rid, outs in final.items():
        assert len(outs) == 1 and final_fields(outs[0]) == final_fields(streamed[rid][-1]), rid
        assert (outs[0].new_token_ids, outs[0].new_text, outs[0].new_logprobs) == \
            (outs[0].token_ids, outs[0].text, outs[0].logprobs)
        assert "".join(o.new_text for o in streamed[rid]) == outs[0].text


def test_final_only_request_is_not_decoded_before_it_ends():
    tokenizer = CountingTokenizer()
    engine = LLMEngine(PagedToyRunner(64), tokenizer, CacheConfig(block_size=BS, num_blocks=64),
                       SchedulerConfig(max_model_len=128), hash_block, ROOT)
    engine.add_request("a", "the quick", SamplingParams(max_tokens=6, output_kind="final_only"))
    for _ in range(5):
        assert engine.step() == [] and tokenizer.decodes == 0
    [out] = engine.step()
    assert out.finished and len(out.token_ids) == 6 and tokenizer.decodes >= 2


def test_generate_asks_for_final_outputs_only():
    engine = make_engine()
    [out] = engine.generate(["the quick"], SamplingParams(max_tokens=4, temperature=1.0, seed=2))
    engine.add_request("s", "the quick", SamplingParams(max_tokens=4, temperature=1.0, seed=2))
    streamed = run_to_end(engine)["s"]
    assert final_fields(out)[:2] == final_fields(streamed[-1])[:2]
    assert out.new_token_ids == out.token_ids and out.new_text == out.text


def test_stream_outputs_are_snapshots_of_their_step():
    """Cumulative fields are read lazily from the request's lists, yet each output shows its own step."""
    engine = make_engine()
    engine.add_request("a", "the quick brown", SamplingParams(max_tokens=6, temperature=1.0, seed=1, logprobs=1))
    outs = run_to_end(engine)["a"]
    for i, out in enumerate(outs):
        assert out.token_ids == outs[-1].token_ids[:i + 1] and out.completion_tokens == i + 1
        assert out.logprobs == outs[-1].logprobs[:i + 1]
        assert out.text == "".join(o.new_text for o in outs[:i + 1])
