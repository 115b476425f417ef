"""Sampler: greedy is argmax, seeded draws depend only on (seed, position), top-k/top-p restrict the support."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from engine.sampler import Sampler, SeenTokens, TokenCounts, apply_penalties, seeded_uniform, seeded_uniforms
from engine.sampling_params import SamplingParams
from tests.unit.reference_sampler import ReferenceSampler, ban_early_stops

VOCAB = 50
EOS = 1


def make_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [rows, vocab]


def test_greedy_rows_are_exactly_argmax():
    logits = make_logits(16)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.5, seed=3)
    params = [greedy if i % 3 else hot for i in range(16)]
    tokens = Sampler().sample(logits, params, list(range(16)))
    argmax = logits.argmax(dim=-1).tolist()
    assert [t for t, p in zip(tokens, params) if p.greedy] == [a for a, p in zip(argmax, params) if p.greedy]
    assert Sampler().sample(logits, [greedy] * 16, [0] * 16) == argmax


def test_seeded_draw_is_independent_of_batch_composition():
    """Row (seed=7, position=p) gives the same token alone, in a batch, at another row index, with neighbours
    of other kinds (greedy, unseeded, filtered)."""
    row = make_logits(1, seed=1)
    others = make_logits(6, seed=2)
    for params in (SamplingParams(temperature=1.0, seed=7),
                   SamplingParams(temperature=0.7, top_k=10, seed=7),
                   SamplingParams(temperature=1.3, top_p=0.8, seed=7)):
        for position in range(5):
            alone = Sampler(seed=1).sample(row, [params], [position])[0]
            neighbours = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=3),
                          SamplingParams(temperature=1.0, seed=7), params, SamplingParams(top_p=0.5, temperature=1.0)]
            batch = torch.cat([others[:3], row, others[3:]])
            batched = Sampler(seed=99).sample(batch, neighbours[:3] + [params] + neighbours[3:],
                                              [9, 9, 9, position, 9, 9, 9])
            assert batched[3] == alone


def test_seeded_draws_vary_with_position_and_seed():
    logits = torch.zeros(1, VOCAB)  # uniform distribution
    by_position = {Sampler().sample(logits, [SamplingParams(temperature=1.0, seed=5)], [p])[0] for p in range(100)}
    by_seed = {Sampler().sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0] for s in range(100)}
    assert len(by_position) > 30 and len(by_seed) > 30


def test_seeded_uniform_is_a_pure_function_in_unit_interval():
    values = [seeded_uniform(s, p) for s in range(20) for p in range(20)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert len(set(values)) == len(values)
    assert seeded_uniform(3, 4) == seeded_uniform(3, 4) != seeded_uniform(4, 3)
    assert seeded_uniform(3, 4, stream=1) != seeded_uniform(3, 4)


def test_unseeded_rows_follow_the_engine_rng():
    logits = make_logits(8)
    params = [SamplingParams(temperature=1.0)] * 8
    assert Sampler(seed=11).sample(logits, params, [0] * 8) == Sampler(seed=11).sample(logits, params, [0] * 8)


def test_top_k_restricts_support_to_k_largest():
    logits = make_logits(1, seed=4)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=5, seed=s) for s in range(300)]
    tokens = Sampler().sample(logits.expand(300, VOCAB), params, [0] * 300)
    assert set(tokens) == top5


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    for top_p, support in ((0.45, {1}), (0.75, {1, 3}), (0.85, {1, 3, 2}), (1.0, {0, 1, 2, 3})):
        params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(400)]
        tokens = Sampler().sample(logits.expand(400, 4), params, [1] * 400)
        assert set(tokens) == support, top_p


def test_top_k_then_top_p_renormalises():
    """top_k=3 leaves {1: .5, 3: .3, 2: .15} renormalised to {.53, .32, .16}; top_p=0.8 then keeps {1, 3}."""
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=s) for s in range(300)]
    assert set(Sampler().sample(logits.expand(300, 4), params, [0] * 300)) == {1, 3}


def test_temperature_sampling_matches_softmax_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    tokens = Sampler().sample(logits.expand(n, 4), params, [0] * n)
    expected = torch.softmax(logits[0], dim=-1).tolist()
    for token_id, p in enumerate(expected):
        observed = tokens.count(token_id) / n
        assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / n), (token_id, observed, p)


def test_masked_tokens_are_never_sampled():
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 17] = 0.0
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(50)]
    assert set(Sampler().sample(logits.expand(50, VOCAB), params, [0] * 50)) == {17}


def test_greedy_ties_take_the_first_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    assert Sampler().sample(logits, [SamplingParams()] * 2, [0, 0]) == [1, 0]


def test_wide_nucleus_falls_back_to_the_whole_vocabulary():
    """A flat distribution's top-p nucleus is wider than the first 256 candidates: still exact and batch-free."""
    logits = torch.linspace(0.0, 0.5, 1000).unsqueeze(0)  # [1, 1000], nearly flat, best tokens last
    probs = torch.softmax(logits[0], dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    nucleus = set(order[(torch.cumsum(sorted_probs, 0) - sorted_probs) < 0.6].tolist())
    n = 3000
    params = [SamplingParams(temperature=1.0, top_p=0.6, seed=s) for s in range(n)]
    tokens = Sampler().sample(logits.expand(n, 1000), params, [0] * n)
    assert set(tokens) <= nucleus and len(set(tokens)) > 400
    mixed = Sampler().sample(torch.cat([logits, logits]), [params[7], SamplingParams(temperature=1.0, top_k=600)],
                             [0, 0])
    assert mixed[0] == tokens[7]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, [(0, p, ([0], [1]))])
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.5]]
    assert logits.tolist() == [[2.0, -1.0, 3.0, 0.5]], "the caller's logits are not modified"
    # greedy with the penalty picks the argmax of the penalised row: token 2 (3.0) beats token 0 (now 1.0)
    assert Sampler().sample(torch.tensor([[4.0, 0.0, 3.0, 0.0]]), [p], [1], [([0], [1])]) == [2]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [(0, p, ([4, 4, 4], [1, 1, 3]))])
    assert out.tolist() == [[0.0, -1.0, 0.0, -0.75, 0.0]]


def test_penalties_need_the_seen_tokens_and_are_validated():
    with pytest.raises(ValueError, match="seen"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(repetition_penalty=1.1)], [0])
    for field, value in [("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_generation_config_gives_defaults_and_explicit_options_win():
    config = {"do_sample": True, "temperature": 0.3, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 50}
    p = SamplingParams.from_generation_config(config, top_p=None, seed=3)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens, p.seed) == (0.3, 0.9, 1.3, 50, 3)
    assert SamplingParams.from_generation_config(config, temperature=0.0).greedy
    assert SamplingParams.from_generation_config({**config, "do_sample": False}).greedy
    assert SamplingParams.from_generation_config({}) == SamplingParams()


def test_logit_bias_is_added_before_sampling_and_only_to_its_row():
    logits = make_logits(4, seed=8)
    argmax = logits.argmax(dim=-1).tolist()
    forced = SamplingParams(logit_bias={7: 100.0})
    banned = SamplingParams(logit_bias={argmax[1]: -100.0})
    tokens = Sampler().sample(logits, [forced, banned, SamplingParams(), forced], [0] * 4)
    assert tokens[0] == tokens[3] == 7
    second = logits[1].clone()
    second[argmax[1]] -= 100.0
    assert tokens[1] == int(second.argmax()) != argmax[1]
    assert tokens[2] == argmax[2]
    hot = SamplingParams(temperature=1.0, seed=5, logit_bias={7: 100.0})
    assert {Sampler().sample(logits[:1], [hot], [p])[0] for p in range(20)} == {7}


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(repetition_penalty=2.0, logit_bias={3: 4.0})
    out = apply_penalties(logits, [(0, params, ([3], []))])
    assert out[0, 3].item() == 2.0  # (0 + 4) / 2, not 0 / 2 + 4


def test_logit_bias_values_are_checked_and_stored_sorted():
    assert SamplingParams(logit_bias={9: 1, 2: -1.5}).logit_bias == ((2, -1.5), (9, 1.0))
    for bad in ({1: 101.0}, {-1: 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Every option the reference sampler has, in random combinations; mostly seeded, so rows are comparable."""
    return SamplingParams(
        max_tokens=20, temperature=rng.choice([0.0, 0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 5, 40, 256, 300, vocab, vocab + 3]), top_p=rng.choice([1.0, 1.0, 0.3, 0.9, 0.99]),
        seed=rng.randrange(2**63) if rng.random() < 0.8 else None,
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4, -0.3]),
        logit_bias=rng.choice([{}, {}, {rng.randrange(vocab): rng.uniform(-5, 5), vocab + 2: 1.0}]),
        min_tokens=rng.choice([0, 0, 3, 10]), stop_token_ids=rng.choice([(), (2, 3)]),
        ignore_eos=rng.random() < 0.3)


@pytest.mark.parametrize("trial", range(40))
def test_batched_sampler_draws_the_reference_tokens(trial):
    """Random batches mixing every option, over steps whose outputs grow (the batched sampler keeps penalty counts
    between steps by key): greedy and seeded rows get exactly the reference's tokens, in fp32. Flat rows (scale
    0.3) send wide top-p nuclei past the first 256 candidates."""
    rng = random.Random(trial)
    vocab, rows = rng.choice([50, 300, 1000]), rng.randint(1, 24)
    params = [random_params(rng, vocab) for _ in range(rows)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 5))] for _ in range(rows)]
    batched, reference = Sampler(seed=1, eos_token_ids=(EOS,)), ReferenceSampler(seed=1)
    gen = torch.Generator().manual_seed(trial)
    for _ in range(4):
        logits = torch.randn(rows, vocab, generator=gen) * rng.choice([0.3, 3.0])  # [rows, vocab]
        positions = [len(o) for o in outputs]
        got = batched.sample(logits, params, positions,
                             [SeenTokens(p, o, f"r{i}") for i, (p, o) in enumerate(zip(prompts, outputs))])
        want = reference.sample(ban_early_stops(logits, params, positions, (EOS,)), params, positions,
                                list(zip(prompts, outputs)))
        comparable = [i for i, p in enumerate(params) if p.greedy or p.seed is not None]
        assert [got[i] for i in comparable] == [want[i] for i in comparable]
        for output, token_id in zip(outputs, got):
            output.append(token_id)


def test_vectorised_seeded_uniforms_are_bit_identical_to_the_scalar_ones():
    rng = random.Random(3)
    seeds = [0, 1, 2**63 - 1, 2**62 + 12345] + [rng.randrange(2**63) for _ in range(500)]
    positions = [0, 2**40, 7, 123456] + [rng.randrange(100_000) for _ in range(500)]
    for stream in (0, 1, 2**32 + 5):
        got = seeded_uniforms(seeds, positions, stream)
        assert got.dtype == np.float64
        assert got.tolist() == [seeded_uniform(s, p, stream) for s, p in zip(seeds, positions)]
        assert seeded_uniforms(seeds[:3], positions[:3], stream).tolist() == got[:3].tolist()  # the scalar path


def seen_pairs(counts: TokenCounts, entries: list[SeenTokens], vocab: int = 6) -> list[tuple[int, int, int]]:
    pairs = counts.pairs(entries, vocab, torch.device("cpu"))
    return list(zip(pairs.row.tolist(), pairs.token.tolist(), pairs.count.tolist()))


def test_token_counts_grow_with_new_outputs_and_rebuild_for_a_new_list():
    counts = TokenCounts()
    prompt, output = [3, 3, 4], [1]
    assert seen_pairs(counts, [SeenTokens(prompt, output, "a")]) == [(0, 1, 1), (0, 3, 0), (0, 4, 0)]
    output += [1, 5]
    assert seen_pairs(counts, [SeenTokens(prompt, output, "a")]) == [(0, 1, 2), (0, 3, 0), (0, 4, 0), (0, 5, 1)]
    assert seen_pairs(counts, [SeenTokens(prompt, [2], "a")]) == [(0, 2, 1), (0, 3, 0), (0, 4, 0)]  # rebuilt
    for i in range(20):  # more keys than the first capacity: the table grows
        seen_pairs(counts, [SeenTokens([0], [i % 6], f"k{i}")])
    assert counts.num_slots == 21
    assert seen_pairs(counts, [SeenTokens([0], [5], "k5"), SeenTokens(prompt, [2], "a")]) == \
        [(0, 0, 0), (0, 5, 1), (1, 2, 1), (1, 3, 0), (1, 4, 0)]
    counts.release("a")
    counts.release("never-seen")
    assert counts.num_slots == 20


def test_penalty_counts_persist_by_key_until_released():
    sampler = Sampler()
    p = SamplingParams(frequency_penalty=1.0)
    logits = torch.tensor([[1.0, 1.5, 0.0]])
    output: list[int] = []
    for want in (1, 0, 1, 0):
        token = sampler.sample(logits, [p], [len(output)], [SeenTokens([2], output, "a")])[0]
        assert token == want
        output.append(token)
    assert sampler.token_counts.num_slots == 1
    sampler.release("a")
    assert sampler.token_counts.num_slots == 0


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # eos (1) is the argmax, then stop token 2
    sampler = Sampler(eos_token_ids=(EOS,))
    p = SamplingParams(min_tokens=2, stop_token_ids=(2,))
    assert [sampler.sample(logits, [p], [n])[0] for n in range(3)] == [3, 3, 1]
    keep_eos = SamplingParams(min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [keep_eos], [0]) == [1]


def test_min_p_drops_tokens_below_a_share_of_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    n = 400
    for min_p, support in ((0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})):
        for extra in ({}, {"top_k": 3}, {"top_p": 0.95}):
            params = [SamplingParams(temperature=1.0, min_p=min_p, seed=s, **extra) for s in range(n)]
            tokens = set(Sampler().sample(probs.log().expand(n, 4), params, [0] * n))
            assert tokens == support - ({3} if "top_k" in extra else set()), (min_p, extra)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
