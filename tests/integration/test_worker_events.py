"""KV events from real worker processes (DESIGN §6, issue 5): a subscriber on a worker's READY endpoints receives
`BlockStored` for the device tier (the engine's block manager) and the host tier (the store) after a prefill, with
the prompt's exact block hashes, parent hashes and token ids, on the worker's own topic; a decode worker announces
the blocks it pulls."""
from __future__ import annotations

import random
import time

import pytest

from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.events import BlockRemoved, BlockStored, ZmqEventSubscriber, worker_topic
from kvstore.hashing import hash_blocks
from engine.config import CacheConfig, ModelConfig
from strata.llm import kv_namespace
from worker_common.client import disaggregated
from worker_common.kv_events import DeviceEvents
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
ARGS = ["--num-blocks", "128", "--max-num-batched-tokens", "256", "--handoff-mib", "8", "--host-tier-mib", "8",
        "--block-size", str(BLOCK_SIZE)]


def make_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 203) for _ in range(length)]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


@pytest.fixture(scope="module")
def fingerprint(model_path) -> bytes:
    """The salt-free namespace root, computed the way every process computes it (DESIGN §3)."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=2)
    return kv_namespace(ModelRunner(ModelConfig(model_path, dtype="float32"), cache), cache, "float32").fingerprint()


@pytest.fixture(scope="module")
def workers(model_path):
    base = ["--model", model_path, "--transfer", "shm", *ARGS]
    prefill = WorkerProcess("prefill", [*base, "--worker-id", "prefill-ev"], wait=False)
    decode = WorkerProcess("decode", [*base, "--worker-id", "decode-ev"], wait=False)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def subscribe(worker: WorkerProcess) -> ZmqEventSubscriber:
    sub = ZmqEventSubscriber(worker.events_endpoint, worker.replay_endpoint, topic="kv-events", from_seq=0)
    time.sleep(0.3)  # NOTE: a SUB misses what is published before its connection completes (replay covers it)
    return sub


def stored_by_medium(sub: ZmqEventSubscriber, want: dict[str, set[bytes]], timeout_s: float = 20.0
                     ) -> dict[str, list[BlockStored]]:
    """BlockStored events per medium that name a wanted hash, until every wanted hash was seen (or the timeout)."""
    got: dict[str, list[BlockStored]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {m: {h for e in got.get(m, []) for h in e.block_hashes} for m in want}
        if all(want[m] <= seen[m] for m in want):
            break
        item = sub.recv(timeout_s=0.5)
        if item is None:
            sub.catch_up()
            continue
        for event in item.batch.events:  # NOTE: the history replayed from 0 holds earlier tests' blocks too
            if isinstance(event, BlockStored) and set(event.block_hashes) & want.get(event.medium, set()):
                got.setdefault(event.medium, []).append(event)
    return got


def assert_chain(events: list[BlockStored], prompt: list[int], hashes: list[bytes]) -> None:
    """Each event's blocks are consecutive blocks of the prompt: parent, hashes and tokens all agree."""
    for event in events:
        first = hashes.index(event.block_hashes[0])
        n = len(event.block_hashes)
        assert event.block_hashes == hashes[first:first + n]
        assert event.parent_block_hash == (hashes[first - 1] if first else None)
        assert event.token_ids == prompt[first * BLOCK_SIZE:(first + n) * BLOCK_SIZE]
        assert event.block_size == BLOCK_SIZE


class Batches:
    def __init__(self) -> None:
        self.published: list[list] = []

    def publish(self, events: list) -> None:
        self.published.append(events)


def test_device_events_coalesce_a_chain_per_step_and_keep_the_order():
    h = [bytes([i]) * 16 for i in range(5)]
    sink = Batches()
    device = DeviceEvents(sink, block_size=2)
    device.on_block_stored(7, h[0], None, [1, 2])
    device.on_block_stored(8, h[1], h[0], [3, 4])        # continues the chain: same event
    device.on_block_removed(h[3])
    device.on_block_removed(h[4])                        # consecutive removals: same event
    device.on_block_stored(9, h[2], h[1], [5, 6])        # after a removal: a new event
    assert sink.published == []                          # nothing leaves before the step ends
    device.flush()
    device.flush()                                       # an empty buffer publishes nothing
    assert sink.published == [[
        BlockStored([h[0], h[1]], None, [1, 2, 3, 4], 2, medium="device"),
        BlockRemoved([h[3], h[4]], medium="device"),
        BlockStored([h[2]], h[1], [5, 6], 2, medium="device")]]


@pytest.mark.timeout(300)
def test_prefill_publishes_device_and_host_blocks_with_the_prompts_hashes(workers, fingerprint):
    prefill, decode = workers
    assert prefill.events_endpoint.startswith("tcp://127.0.0.1:") and prefill.replay_endpoint
    sub = subscribe(prefill)
    prompt = make_prompt(1, 3 * BLOCK_SIZE + 5)          # 3 full blocks, all cacheable
    hashes = hash_blocks(fingerprint, prompt, BLOCK_SIZE)
    assert len(hashes) == 3
    try:
        disaggregated(prefill.stub(), decode.stub(), "ev-1", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        got = stored_by_medium(sub, {"device": set(hashes), "host": set(hashes)})
    finally:
        sub.close()
    assert {h for e in got["device"] for h in e.block_hashes} == set(hashes)
    assert {h for e in got["host"] for h in e.block_hashes} == set(hashes)
    assert_chain(got["device"], prompt, hashes)
    assert_chain(got["host"], prompt, hashes)
    assert len(got["device"]) == 1, "blocks committed in one step are one chained BlockStored"


@pytest.mark.timeout(300)
def test_events_are_on_the_workers_topic_and_replayable_from_zero(workers, fingerprint):
    """A subscriber that joins late gets the whole buffered history through the replay socket."""
    prefill, decode = workers
    prompt = make_prompt(2, 2 * BLOCK_SIZE + 1)
    hashes = hash_blocks(fingerprint, prompt, BLOCK_SIZE)
    disaggregated(prefill.stub(), decode.stub(), "ev-2", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    late = ZmqEventSubscriber(prefill.events_endpoint, prefill.replay_endpoint, topic="kv-events", from_seq=0)
    try:
        assert late.catch_up() > 0
        items = []
        while (item := late.recv(timeout_s=0.2)) is not None:
            items.append(item)
        time.sleep(0.3)
        disaggregated(prefill.stub(), decode.stub(), "ev-2b", make_prompt(4, BLOCK_SIZE + 1),
                      SamplingParams(max_tokens=2, ignore_eos=True))
        live = late.recv(timeout_s=20)
    finally:
        late.close()
    assert [i.seq for i in items] == list(range(len(items)))
    assert live is not None and not live.replayed and live.seq == len(items)
    assert live.topic == worker_topic("prefill-ev")
    device = {h for i in items for e in i.batch.events if isinstance(e, BlockStored) and e.medium == "device"
              for h in e.block_hashes}
    assert set(hashes) <= device


@pytest.mark.timeout(300)
def test_decode_worker_announces_pulled_and_computed_blocks(workers, fingerprint):
    """The decode worker installs the handle's blocks (device BlockStored, from install_blocks) and writes the
    finished request's new full blocks to its host tier (host BlockStored): not the handed-over ones, which the
    prefill worker stored already (DESIGN §2 step 5)."""
    prefill, decode = workers
    sub = subscribe(decode)
    params = SamplingParams(max_tokens=BLOCK_SIZE + 2, ignore_eos=True)
    prompt = make_prompt(3, 2 * BLOCK_SIZE + 3)
    try:
        done = disaggregated(prefill.stub(), decode.stub(), "ev-3", prompt, params)
        full = prompt + done.token_ids
        hashes = hash_blocks(fingerprint, full[:-1], BLOCK_SIZE)   # the last token has no KV
        got = stored_by_medium(sub, {"device": set(hashes), "host": set(hashes[2:])})
        late = stored_by_medium(sub, {"host": set(hashes[:2])}, timeout_s=1.0)  # a second to show up, if ever
    finally:
        sub.close()
    assert done.last_chunk.blocks_transferred == 2
    assert set(hashes) <= {h for e in got["device"] for h in e.block_hashes}
    assert set(hashes[2:]) <= {h for e in got["host"] for h in e.block_hashes}
    assert not {h for e in got["host"] + late.get("host", []) for h in e.block_hashes} & set(hashes[:2])
    assert_chain(got["device"], full, hashes)
    assert_chain(got["host"], full, hashes)
