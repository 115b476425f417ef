"""Speculative decoding's bookkeeping and verification rules, without a model: the scheduler's verify steps, the
n-gram drafter, the point-mass and sampled verifiers, and the adaptive length controller."""
from __future__ import annotations

import torch
import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.spec.adaptive import AdaptiveLength
from engine.spec.drafter import DraftInput
from engine.spec.ngram import NgramDrafter
from engine.spec.verify import residual_draw, verify_point_masses, verify_sampled
from kvstore.hashing import Namespace, hash_block

BS = 4
ROOT = Namespace("test-model", "bs4", "float32").fingerprint()


def make_scheduler(num_blocks: int = 16, **kw) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64, **kw})
    return Scheduler(config, BlockManager(num_blocks, BS, hash_block, ROOT), eos_token_ids=[0])


def decoding_request(scheduler: Scheduler, num_prompt: int = 6, max_tokens: int = 16) -> Request:
    """A request whose prompt ran and whose first token (7) was sampled: its next step is a decode."""
    request = Request("r", list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=max_tokens))
    scheduler.add_request(request)
    step = scheduler.schedule()
    scheduler.update(step, [[7]])
    return request


# ----- scheduler

def test_verify_step_schedules_last_token_and_drafts_with_their_logits():
    scheduler = make_scheduler()
    request = decoding_request(scheduler)
    request.spec_token_ids = [8, 9, 10]
    seq = scheduler.schedule().batch.seqs[0]
    assert (seq.token_ids, seq.start_pos, seq.num_logits, seq.num_draft) == ([7, 8, 9, 10], 6, 4, 3)
    assert len(seq.block_table) == 3          # positions 6..9 need blocks 1 and 2 as well


def test_update_counts_only_accepted_drafts_as_computed():
    scheduler = make_scheduler()
    request = decoding_request(scheduler)
    request.spec_token_ids = [8, 9, 10]
    step = scheduler.schedule()
    (update,) = scheduler.update(step, [[8, 42]])        # d_1 accepted, d_2 replaced by 42
    assert update.new_token_ids == [8, 42]
    assert request.num_computed_tokens == 8              # the last token and d_1; 42 is not computed yet
    assert request.output_token_ids == [7, 8, 42]
    scheduler.check_integrity()


def test_drafts_are_trimmed_to_the_budget_and_to_max_tokens():
    scheduler = make_scheduler(max_num_batched_tokens=3)
    request = decoding_request(scheduler, num_prompt=3, max_tokens=16)
    request.spec_token_ids = [8, 9, 10, 11]
    assert scheduler.schedule().batch.seqs[0].num_draft == 2      # budget 3 = last token + 2 drafts
    scheduler = make_scheduler()
    request = decoding_request(scheduler, max_tokens=3)           # one output so far: room for 2 more
    request.spec_token_ids = [8, 9, 10, 11]
    assert scheduler.schedule().batch.seqs[0].num_draft == 1      # the bonus token is the last output


def test_drafts_never_preempt_another_request():
    scheduler = make_scheduler(num_blocks=3)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=7))
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=7))
    scheduler.add_request(a)
    scheduler.add_request(b)
    step = scheduler.schedule()
    scheduler.update(step, [[7], [7]])                            # a in block 0, b in block 1, one block free
    a.spec_token_ids = [8, 9, 10, 11, 12]                         # positions 4..8 would need two more blocks
    step = scheduler.schedule()
    assert not step.preempted
    assert [(s.request_id, s.num_draft) for s in step.batch.seqs] == [("a", 0), ("b", 0)]
    scheduler.check_integrity()


# ----- n-gram drafter

def ngram_proposal(tokens: list[int], k: int = 3, min_n: int = 1, max_n: int = 3, drafter=None) -> list[int]:
    drafter = drafter or NgramDrafter(min_n, max_n)
    request = Request("r", tokens, SamplingParams())
    return drafter.propose([DraftInput(request, k, False)], [None])[0].token_ids


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    #             a  b  c  X  Y  Z  a  b  c  P  Q  a  b  c
    tokens = [1, 2, 3, 10, 11, 12, 1, 2, 3, 20, 21, 1, 2, 3]
    assert ngram_proposal(tokens) == [20, 21, 1]
    assert ngram_proposal([5, 6, 7]) == []
    assert ngram_proposal([4, 9, 4], k=2) == [9, 4]                 # a 1-gram match: the longest tried first


def test_ngram_index_grows_with_the_request():
    drafter = NgramDrafter(1, 3)
    request = Request("r", [1, 2, 3, 4], SamplingParams())
    assert drafter.propose([DraftInput(request, 2, False)], [None])[0].token_ids == []
    for t in (1, 2):
        request.append_output(t)
    assert drafter.propose([DraftInput(request, 2, False)], [None])[0].token_ids == [3, 4]
    drafter.release("r")
    drafter.release("unknown")


# ----- verification

def test_point_masses_accept_the_matching_prefix_then_the_target_token():
    assert verify_point_masses([5, 6, 7], [5, 6, 9, 1]) == ([5, 6, 9], 2)
    assert verify_point_masses([5, 6], [5, 6, 8]) == ([5, 6, 8], 2)      # all accepted: the bonus token
    assert verify_point_masses([5], [4, 8]) == ([4], 0)


def test_sampled_verifier_accepts_where_p_covers_q_and_resamples_the_residual():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert verify_sampled([0], q, p, bonus=2, accept_u=[0.99], residual_u=[0.0]) == ([0, 2], 1)  # p/q = 2
    # token 2 has p = 0: always rejected; the residual max(0, p - q) = [0.25, 0.25, 0] normalised
    assert verify_sampled([2], q, p, bonus=0, accept_u=[0.0], residual_u=[0.6]) == ([1], 0)
    assert residual_draw(p[0], q[0], 0.1) == 0


def test_broken_verifier_accepts_with_p():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert verify_sampled([0], q, p, bonus=2, accept_u=[0.6], residual_u=[0.0], broken=True).num_accepted == 0


# ----- adaptive length

def test_adaptive_length_follows_acceptance():
    controller = AdaptiveLength(max_tokens=4)
    assert controller.length("r") >= 1                       # the prior: worth a try
    for _ in range(20):
        controller.record("r", 4, 4)
    assert controller.length("r") == 4
    for _ in range(60):
        controller.record("r", 4, 0)
    assert controller.length("r") == 0                       # off for this request, ...
    lengths = [controller.length("r") for _ in range(controller.probe_every)]
    assert lengths.count(1) == 1                             # ... but probed again now and then


def test_batch_speculates_when_expected_tokens_per_second_beat_plain_steps():
    controller = AdaptiveLength(max_tokens=4)
    assert controller.speculate_batch(8, expected=16.0)           # no step time yet: measure speculation
    controller.record_step(8, True, seconds=1.0, expected=16.0)
    assert not controller.speculate_batch(8, expected=16.0)       # then the plain step
    controller.record_step(8, False, seconds=0.25, expected=16.0)
    # 16 tokens per 1.0 s against 8 per 0.25 s: plain wins; 40 tokens per 1.0 s would win
    assert not controller.speculate_batch(8, expected=16.0)
    assert controller.speculate_batch(8, expected=40.0)
    assert not controller.speculate_batch(8, expected=8.0)        # nothing proposed: nothing to gain


def test_losing_mode_is_refreshed_ever_less_often():
    controller = AdaptiveLength(max_tokens=4, explore_every=2, max_explore_every=64)
    controller.record_step(8, True, seconds=1.0, expected=16.0)
    controller.record_step(8, False, seconds=0.25, expected=16.0)
    probes = []
    for step in range(300):
        choice = controller.speculate_batch(8, expected=16.0)
        if choice:
            probes.append(step)
        controller.record_step(8, choice, seconds=1.0 if choice else 0.25, expected=16.0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    assert gaps[0] > 2 * 4                  # a verify step worth 4 plain ones waits 4x explore_every at least
    assert controller.speculate_batch(4, expected=6.0)            # a smaller batch is measured on its own
    # a larger one starts from bucket 8's loss, scaled: no probe that cannot win
    controller.record_step(16, False, seconds=0.5, expected=32.0)
    assert not controller.speculate_batch(16, expected=32.0)


def test_warm_up_step_times_decide_from_the_first_step():
    """Seeded with the compiled steps' warm-up times, a bucket where speculation cannot pay never probes it before
    its first refresh (as long a wait as a measured loss), and one where it pays speculates at once."""
    controller = AdaptiveLength(max_tokens=4, explore_every=8)
    controller.seed({1: 0.010, 8: 0.010, 32: 0.010}, {1: 0.012, 8: 0.040, 32: 0.040})
    assert controller.speculate_batch(1, expected=3.0)           # 3 tokens per 12 ms beat 1 per 10 ms
    choices = []
    for _ in range(32):
        choices.append(controller.speculate_batch(32, expected=64.0))   # 64 per 40 ms lose to 32 per 10 ms
        controller.record_step(32, choices[-1], seconds=0.040 if choices[-1] else 0.010, expected=64.0)
    assert not any(choices)                                      # the first refresh waits 8 x 4 steps
    assert controller.speculate_batch(32, expected=64.0)         # then the losing mode is measured again
    controller.seed({8: 1.0}, {8: 0.001})                        # a bucket already timed keeps its times
    assert not controller.speculate_batch(8, expected=9.0)


def test_speculative_config_names_the_field():
    with pytest.raises(ValueError, match="speculative method"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative must be one of"):
        SamplingParams(speculative="on")


def _plain_steps(spec, request: Request, next_token, steps: int) -> list[int]:
    """`steps` engine steps of one request with speculation judged on each: the step's drafts (if the batch
    speculated) are dropped, the request emits `next_token(request)` as a plain decode would, and the unverified
    draft of the step (if any) is scored. Returns the draft counts proposed per step."""
    from engine.batch import ScheduledSeq
    proposed = []
    for _ in range(steps):
        spec.propose([request])
        proposed.append(len(request.spec_token_ids))
        request.spec_token_ids = []
        token = next_token(request)
        spec.check_shadows([ScheduledSeq(request.request_id, [request.token_ids[-1]], request.num_tokens - 1, [0])],
                           [[token]])
        request.append_output(token)
    return proposed


@pytest.mark.parametrize("shadows", [True, False])
def test_a_plain_batch_learns_its_acceptance_from_unverified_ngram_drafts(monkeypatch, shadows):
    """A batch judged too slow to speculate (a verify costs 4 plain steps, the prior acceptance does not pay for
    it) still scores the n-gram drafter's proposal every other step against the token emitted: a request that
    repeats itself earns speculation back without a verify. Without the shadow drafts (the code before) it never
    does. A request whose drafts miss stays plain."""
    import engine.spec.speculation as speculation
    from engine.spec.speculation import Speculation
    if not shadows:
        monkeypatch.setattr(speculation, "SHADOW_EVERY", 10 ** 9)
    spec = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4), {"ngram": NgramDrafter(1, 3)})
    spec.controller.seed({1: 0.001}, {1: 0.004})
    looping = Request("loop", [5, 6, 7, 8, 9, 10, 5, 6], SamplingParams(max_tokens=200))
    cycle = lambda r: 5 + r.num_tokens % 6               # noqa: E731 - continues 7 8 9 10 5 6 7 ...
    proposed = _plain_steps(spec, looping, cycle, 60)
    assert any(proposed) == shadows

    spec = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4), {"ngram": NgramDrafter(1, 3)})
    spec.controller.seed({1: 0.001}, {1: 0.004})
    drifting = Request("drift", [5, 6, 7, 8, 9, 10, 5, 6], SamplingParams(max_tokens=200))
    fresh = lambda r: 1000 + r.num_tokens                # noqa: E731 - never what came before
    assert not any(_plain_steps(spec, drifting, fresh, 60))
