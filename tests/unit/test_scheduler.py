"""Scheduler: continuous batching, chunked prefill, preemption by recompute, abort, stop conditions. No torch."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep, Scheduler
from kvstore.hashing import Namespace, hash_block
from engine.config import SchedulerConfig

BS = 4
EOS = 0
ROOT = Namespace("test-model", "bs4", "float32").fingerprint()


def make_scheduler(num_blocks: int = 16, **kw) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64, **kw})
    return Scheduler(config, BlockManager(num_blocks, BS, hash_block, ROOT), eos_token_ids=[EOS])


def make_request(request_id: str, num_prompt: int, first_token: int = 100, **params) -> Request:
    params = {"max_tokens": 16, **params}
    return Request(request_id, list(range(first_token, first_token + num_prompt)), SamplingParams(**params))


def shape(step: ScheduledStep) -> list[tuple]:
    """(id, start_pos, num_tokens, block_table, num_logits) per scheduled sequence."""
    return [(s.request_id, s.start_pos, len(s.token_ids), s.block_table, s.num_logits) for s in step.batch.seqs]


def run(scheduler: Scheduler, step: ScheduledStep, token_id: int = 7):
    """Pretend the runner ran the step and sampled `token_id` for every sequence that has logits."""
    updates = scheduler.update(step, [[token_id] if s.num_logits else [] for s in step.batch.seqs])
    scheduler.check_integrity()
    return updates


def test_prefill_then_decode_follow_the_counters():
    s = make_scheduler()
    a = make_request("a", 10)
    s.add_request(a)
    step = s.schedule()
    assert shape(step) == [("a", 0, 10, [0, 1, 2], 1)]
    assert step.batch.seqs[0].token_ids == list(range(100, 110))
    [update] = run(s, step, token_id=5)
    assert update.new_token_ids == [5] and a.num_computed_tokens == 10 and a.num_tokens == 11
    step = s.schedule()
    assert shape(step) == [("a", 10, 1, [0, 1, 2], 1)] and step.batch.seqs[0].token_ids == [5]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", 10))
    shapes = []
    for _ in range(4):
        step = s.schedule()
        shapes.append(shape(step))
        run(s, step)
    assert shapes == [
        [("a", 0, 4, [0], 0)],
        [("a", 4, 4, [0, 1], 0)],
        [("a", 8, 2, [0, 1, 2], 1)],
        [("a", 10, 1, [0, 1, 2], 1)],
    ]


def test_chunked_prefill_emits_no_tokens_before_the_last_chunk():
    s = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", 6)
    s.add_request(a)
    assert run(s, s.schedule()) == []
    assert a.output_token_ids == []
    [update] = run(s, s.schedule())
    assert update.request is a and a.output_token_ids == [7]


def test_batch_order_is_decodes_then_prefill_chunks_then_new_requests():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", 2))
    s.add_request(make_request("b", 10, first_token=200))
    step = s.schedule()
    assert shape(step) == [("a", 0, 2, [0], 1), ("b", 0, 6, [1, 2], 0)]
    run(s, step)
    s.add_request(make_request("c", 3, first_token=300))
    step = s.schedule()
    assert shape(step) == [("a", 2, 1, [0], 1), ("b", 6, 4, [1, 2, 3], 1), ("c", 0, 3, [4], 1)]


def test_max_num_seqs_limits_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 3, first_token=100 * (i + 1)))
    step = s.schedule()
    assert [q.request_id for q in step.batch.seqs] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_preemption_frees_the_newest_request_and_resumes_it_from_the_prefix_cache():
    s = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=3), make_request("b", 7, first_token=200, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    assert shape(step) == [
        ("a", 0, 7, [0, 1], 1), ("b", 0, 7, [2, 3], 1)]
    run(s, step)
    run(s, s.schedule())                               # both decode into their second block (position 7)
    step = s.schedule()                                # a needs a third block: b is preempted
    assert shape(step) == [("a", 8, 1, [0, 1, 3], 1)]  # b's tail block 3 was evicted first
    assert step.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [7, 7]
    run(s, step)                                       # a reaches max_tokens=3 and frees [3, 1, 0]
    assert a.finish_reason == "length"
    step = s.schedule()                                # b recomputes prompt + outputs; block 2 is a prefix hit
    assert shape(step) == [("b", 4, 5, [2, 3, 1], 1)]
    assert step.batch.seqs[0].token_ids == [204, 205, 206, 7, 7]
    run(s, step)
    assert b.output_token_ids == [7, 7, 7] and b.num_cached_tokens == 0


def test_request_that_could_never_fit_is_refused_up_front():
    """A request that could not finish even alone in the cache would preempt itself forever."""
    s = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("big", 7, max_tokens=4))
    s.add_request(make_request("ok", 7, max_tokens=2))
    run(s, s.schedule())
    [update] = run(s, s.schedule())
    assert update.request.finish_reason == "length" and not s.has_unfinished()


def test_abort_waiting_and_running_requests_frees_their_blocks():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5, first_token=200)
    s.add_request(a)
    s.add_request(b)
    run(s, s.schedule())
    assert s.abort("b") is b and b.finish_reason == "abort"
    assert s.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert s.abort("a") is None and s.abort("nope") is None
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 16
    s.check_integrity()


def test_abort_between_schedule_and_update_is_ignored_by_update():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    step = s.schedule()
    s.abort("a")
    assert run(s, step) == []


@pytest.mark.parametrize("params, tokens, reason, num_outputs", [
    ({}, [7, EOS, 7], "stop", 2),
    ({"ignore_eos": True, "max_tokens": 3}, [7, EOS, 7, 7], "length", 3),
    ({"stop_token_ids": (9,)}, [7, 9, 7], "stop", 2),
    ({"max_tokens": 2}, [7, 7, 7], "length", 2),
])
def test_stop_conditions(params, tokens, reason, num_outputs):
    s = make_scheduler()
    a = make_request("a", 3, **params)
    s.add_request(a)
    for token_id in tokens:
        if not s.has_unfinished():
            break
        run(s, s.schedule(), token_id)
    assert a.finish_reason == reason and a.num_output_tokens == num_outputs
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 16


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=6)
    a = make_request("a", 4)
    s.add_request(a)
    while s.has_unfinished():
        run(s, s.schedule())
    assert a.finish_reason == "length" and a.num_tokens == 6


def test_add_request_rejects_bad_input():
    s = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("long", 9))
    s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="non-empty"):
        Request("empty", [], SamplingParams())


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(make_request("a", 2))
    run(s, s.schedule())
    s.add_request(make_request("b", 64, first_token=200, max_tokens=1))
    step = s.schedule()                                # a's decode leaves 63 tokens of budget: b waits
    assert [(q.request_id, len(q.token_ids)) for q in step.batch.seqs] == [("a", 1)]
    run(s, step)
    s.abort("a")
    step = s.schedule()
    assert [(q.request_id, len(q.token_ids), q.num_logits) for q in step.batch.seqs] == [("b", 64, 1)]


def test_shared_prefix_is_hit_by_a_later_request():
    s = make_scheduler()
    s.add_request(make_request("a", 9))
    run(s, s.schedule())
    b = make_request("b", 9)
    s.add_request(b)
    step = s.schedule()
    assert shape(step)[1] == ("b", 8, 1, [0, 1, 3], 1)
    assert b.num_cached_tokens == 8


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(0, 9),
                          st.integers(1, 30), st.integers(0, 3)), max_size=60),
       st.integers(4, 24), st.booleans())
def test_integrity_holds_under_random_traffic(ops, budget, chunked):
    """Small cache (forces preemption), shared prompt prefixes (forces hits), aborts at any point."""
    s = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=budget if chunked else 64,
                       enable_chunked_prefill=chunked)
    for op, slot, length, variant in ops:
        if op == "add" and s.get_request(f"r{slot}") is None:
            request = Request(f"r{slot}", list(range(length)) + [variant], SamplingParams(max_tokens=variant + 2))
            try:
                s.add_request(request)
            except ValueError:
                pass  # could never fit in 12 blocks
        elif op == "abort":
            s.abort(f"r{slot}")
        elif op == "step":
            run(s, s.schedule(), token_id=1 + variant)
        s.check_integrity()
    while s.has_unfinished():
        run(s, s.schedule())
    assert s.block_manager.num_free_blocks == 12


def test_decode_steps_reuse_the_block_table_until_it_grows():
    """A step's block table is a copy that later steps never change; decode steps within one block hand out the
    same copy (no per-step copy of every table), a new one once the table grew."""
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    run(s, s.schedule())
    tables = []
    for _ in range(4):                       # positions 5, 6, 7 (block 1), then 8 (block 2)
        step = s.schedule()
        tables.append(step.batch.seqs[0].block_table)
        run(s, step)
    assert tables[0] is tables[1] is tables[2] and tables[0] == [0, 1]
    assert tables[3] == [0, 1, 2] and tables[0] == [0, 1]
