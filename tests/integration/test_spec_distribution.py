"""The statistical must-show of issue 13: with speculation (a draft model whose q differs from the target's p,
drafts sampled from q, verified by exact rejection sampling), the next tokens of a fixed prompt at temperature 1.0
are distributed as the target's own; a deliberately broken verifier (accept with probability p instead of
min(1, p / q)) fails the same test.

Each request draws t1 in its prefill step (no speculation) and t2 in a verify step (one draft, accepted or
replaced by a residual draw; a bonus t3 when accepted). The reference for t2 is exact:
P(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), from the target's own logits for every t1. Chi-square over
10,000 samples, cells with an expected count below 5 pooled.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.sampling_params import SamplingParams
from engine.spec import speculation as speculation_module
from engine.spec.verify import verify_sampled
from tests.integration.spec_factories import spec_llm

NUM_SAMPLES = 10_000
PROMPT = [5, 17, 42, 8, 99, 23, 61]
PARAMS = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny per-sequence attention calls: with two OpenMP threads on a loaded 2-core machine each
    call waits milliseconds for the other thread (measured: 8 ms against 11 us on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tiny_checkpoint, tmp_path_factory):
    from tests.conftest import build_tiny_checkpoint
    target = tiny_checkpoint("llama").path
    draft = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft_q"), seed=3).path
    return target, draft


def reference_t2(llm) -> np.ndarray:
    """Exact P(t2) for PROMPT from the target's logits: one batch of |V| sequences PROMPT + [t1]."""
    runner = llm.engine.runner
    vocab = runner.vocab_size
    first = torch.softmax(_logits(runner, [PROMPT]), dim=-1)[0]                        # [V]
    second = torch.softmax(_logits(runner, [PROMPT + [t] for t in range(vocab)]), dim=-1)   # [V, V]
    return (first.double() @ second.double()).numpy()


def _logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    """Last-position float32 logits of each prompt, computed in the engine's own runner (blocks past the ones the
    engine uses, so its cache is untouched where it matters)."""
    bs = runner.block_size
    need = -(-len(prompts[0]) // bs)
    first_free = runner.num_blocks - need * len(prompts)
    seqs = [ScheduledSeq(f"ref{i}", p, 0, list(range(first_free + i * need, first_free + (i + 1) * need)))
            for i, p in enumerate(prompts)]
    out = runner.execute(StepBatch(seqs))
    runner.attention.invalidate()
    return out


def sample_t2(llm) -> np.ndarray:
    outs = llm.generate([PROMPT] * NUM_SAMPLES, PARAMS)
    return np.bincount([o.token_ids[1] for o in outs], minlength=llm.engine.runner.vocab_size)


def chi_square_p(observed: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs[keep] - exp[keep]) ** 2) / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def make_llm(models):
    target, draft = models
    return spec_llm(target, "draft", draft, k=1, max_num_seqs=256, num_blocks=4096, seed=1)


def test_speculative_samples_follow_the_target_distribution(models):
    llm = make_llm(models)
    probs = reference_t2(llm)
    counts = sample_t2(llm)
    stats = llm.engine.speculation.stats
    # the test is only meaningful if drafts were verified, and both accepted and rejected
    assert stats.num_draft_tokens >= NUM_SAMPLES * 0.9
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_p(counts, probs) > 0.01


def test_a_broken_verifier_fails_the_same_test(models, monkeypatch):
    monkeypatch.setattr(speculation_module, "verify_sampled", functools.partial(verify_sampled, broken=True))
    llm = make_llm(models)
    probs = reference_t2(llm)
    assert chi_square_p(sample_t2(llm), probs) < 0.01
