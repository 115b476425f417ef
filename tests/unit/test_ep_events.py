"""Which rank of an expert-parallel group holds which blocks (`worker_common.ep_events.RankHoldings`): the union
the group announces to the router, and the front's choice of the rank holding a prompt's prefix."""
from __future__ import annotations

import time
from types import SimpleNamespace

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, ZmqEventPublisher, worker_topic
from kvstore.events.subscriber import ZmqEventSubscriber
from kvstore.hashing import hash_blocks
from worker_common.ep_events import EventRelay, RankHoldings
from worker_common.ep_front import PREFIX_LOAD_SLACK, EPFront
from worker_common.fleet_tls import FleetTls

BLOCK = 4
ROOT = b"\x01" * 16


def stored(*hashes: bytes, medium: str | None = None) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * BLOCK * len(hashes), BLOCK, medium=medium)


def test_a_block_is_announced_by_its_first_holder_and_removed_by_its_last():
    holdings = RankHoldings(2)
    assert holdings.apply(1, [stored(b"a", b"b")]) == [stored(b"a", b"b")]
    assert holdings.apply(0, [stored(b"a")]) == []                  # the group held it already
    assert holdings.apply(1, [BlockRemoved([b"a", b"b"])]) == [BlockRemoved([b"b"], None)]   # rank 0 keeps "a"
    assert holdings.apply(0, [BlockRemoved([b"a"])]) == [BlockRemoved([b"a"], None)]


def test_tiers_are_kept_apart_and_a_clear_removes_only_what_no_other_rank_holds():
    holdings = RankHoldings(2)
    holdings.apply(1, [stored(b"a", b"b"), stored(b"a", medium="host")])
    holdings.apply(0, [stored(b"b")])
    assert holdings.apply(1, [AllBlocksCleared(medium="host")]) == [BlockRemoved([b"a"], "host")]
    out = holdings.apply(1, [AllBlocksCleared()])
    assert out == [BlockRemoved([b"a"], "device")]                  # "b" stays: rank 0 holds it


def test_prefix_lengths_count_leading_blocks_held_in_any_of_a_ranks_own_tiers():
    holdings = RankHoldings(3)
    holdings.apply(1, [stored(b"a", b"b")])
    holdings.apply(2, [stored(b"a", medium="GPU"), stored(b"b", medium="device"), stored(b"c", medium="host"),
                       stored(b"d", medium="redis")])
    assert holdings.prefix_lengths([b"a", b"b", b"c", b"d"]) == [0, 2, 3]   # redis is shared: not a rank's own


def make_front(holdings: RankHoldings) -> EPFront:
    bundle = SimpleNamespace(fingerprint_for=lambda salt: ROOT, block_size=BLOCK)
    config = SimpleNamespace(block_size=BLOCK, cluster_secret="", fleet_tls=FleetTls)  # FleetTls(): off
    local = SimpleNamespace(bundle=bundle, config=config, worker_id="w",
                            draining=False, address="")
    return EPFront(local, ["127.0.0.1:1", "127.0.0.1:2"], holdings=holdings)


def test_the_front_sends_a_prompt_to_the_rank_holding_its_longest_prefix_within_the_load_guard():
    prompt = list(range(3, 3 + 3 * BLOCK))
    hashes = hash_blocks(ROOT, prompt, BLOCK)
    holdings = RankHoldings(3)
    holdings.apply(1, [stored(*hashes[:1])])
    holdings.apply(2, [stored(*hashes[:2])])
    front = make_front(holdings)
    try:
        assert front.pick(prompt) == 2
        front._inflight[2] = PREFIX_LOAD_SLACK          # still within the guard of the idle ranks
        assert front.pick(prompt) == 2
        front._inflight[2] = PREFIX_LOAD_SLACK + 1      # beyond it: the least busy rank, by load alone
        assert front.pick(prompt) in (0, 1)
        assert front.pick(list(range(100, 100 + 2 * BLOCK))) in (0, 1)     # nothing cached: load decides
    finally:
        front.close()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_relay_republishes_other_ranks_events_on_rank_zeros_stream_and_keeps_them_apart():
    """Rank 0's stream carries rank 1's blocks (for the router) with data_parallel_rank 1: the relay, which also
    reads rank 0's stream, must not take them for rank 0's own."""
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=worker_topic(f"w{r}")) for r in (0, 1)]
    router = ZmqEventSubscriber(pubs[0].endpoint, pubs[0].replay_endpoint, topic=worker_topic("w0"), from_seq=0)
    holdings = RankHoldings(2)
    relay = EventRelay(holdings, [(r, f"w{r}", p.endpoint, p.replay_endpoint) for r, p in enumerate(pubs)],
                       pubs[0].publish_batch)
    try:
        pubs[0].publish([stored(b"a" * 16)])
        pubs[1].publish([stored(b"b" * 16)])
        wait_for(lambda: holdings.prefix_lengths([b"b" * 16]) == [0, 1])
        seen = []
        wait_for(lambda: seen.extend(b for b in [router.recv(0.05)] if b) or len(seen) >= 2)
        assert [(b.batch.data_parallel_rank, b.batch.events[0].block_hashes) for b in seen] == \
            [(0, [b"a" * 16]), (1, [b"b" * 16])]
        time.sleep(0.2)
        assert holdings.prefix_lengths([b"a" * 16]) == [1, 0] and holdings.prefix_lengths([b"b" * 16]) == [0, 1]
    finally:
        relay.close()
        router.close()
        for p in pubs:
            p.close()
