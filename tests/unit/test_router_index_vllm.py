"""The prefix index and the mixed-fleet match with what vLLM workers publish (issue 18): media of every vLLM release
(unknown ones skipped and counted, never an error), KV-cache groups (`group_idx`), and a vLLM worker's cached run
put on the model's block grid."""
from __future__ import annotations

import pytest

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index import IndexConfig, PrefixIndex, normalize_medium, tier_of_medium
from router.mixed_routing import _on_grid, vllm_match
from router.vllm_hashing import VllmHashConfig, VllmRequestKeys, vllm_block_keys
from router.vllm_workers import VllmWorkerSpec

H = [100 + i for i in range(6)]


def stored(hashes, medium="GPU", group=None) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * 4 * len(hashes), 4, None, medium, group_idx=group)


def removed(hashes, medium="GPU", group=None) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group)


def apply(index: PrefixIndex, *events, worker="w", seq=None):
    seq = index.expected_seq(worker) or 0 if seq is None else seq
    return index.apply(worker, KVEventBatch(0.0, list(events)), seq)


def test_every_vllm_medium_maps_to_a_local_tier():
    assert [tier_of_medium(m) for m in ("GPU", "CPU", "STORAGE", "FS", "OBJ", None)] == \
        ["device", "host", "disk", "disk", "disk", "device"]
    assert tier_of_medium("NVME_X") is None
    with pytest.raises(ValueError, match="medium must be one of"):
        normalize_medium("NVME_X")


def test_an_unknown_medium_is_skipped_and_counted_and_the_batch_applies():
    index = PrefixIndex()
    result = apply(index, stored(H[:2], "NVME_X"), stored(H[:3], "OBJ"), removed(H[:1], "NVME_X"),
                   AllBlocksCleared("NVME_X"))
    assert (result.status, result.num_events, result.skipped) == ("applied", 1, 3)
    assert index.unknown_media == {"NVME_X": 3}
    assert index.match(H[:3]).for_worker("w").tier_run("disk") == 3
    assert index.match(H[:3]).shared_masks == (0, 0, 0)  # OBJ is the worker's own storage, never pooled
    index.load_snapshot("w", [(H[0], "NVME_X"), (H[1], "CPU")], 9)
    assert index.blocks_of("w") == {H[1]: ("host",)} and index.unknown_media["NVME_X"] == 4
    index.check_integrity()


def test_a_block_stays_while_any_of_its_groups_holds_it():
    index = PrefixIndex()
    apply(index, stored(H[:4], group=0), stored(H[:4], group=1))
    apply(index, removed(H[:2], group=1))                  # the sliding-window group lets go of the old blocks
    assert index.match(H[:4]).for_worker("w").tier_run("device") == 4
    apply(index, removed(H[:1], group=0))
    assert index.match(H[:4]).for_worker("w").tier_run("device") == 0
    assert index.num_blocks("w") == 3
    apply(index, removed(H[1:4]))                          # no group named: every group's copy goes
    assert index.num_blocks("w") == 0
    index.check_integrity()


def test_groups_are_per_tier_and_forgotten_with_the_entry():
    index = PrefixIndex(IndexConfig(max_blocks_per_worker=3))
    apply(index, stored(H[:2], "GPU", 0), stored(H[:2], "CPU", 1))
    apply(index, removed(H[:2], "CPU", 1))                 # the host copy (group 1) goes; the device one stays
    assert index.blocks_of("w") == {H[0]: ("device",), H[1]: ("device",)}
    apply(index, stored(H[2:5], group=0))                  # the bound drops the oldest entries and their groups
    assert index.num_dropped == 2
    index.check_integrity()
    apply(index, AllBlocksCleared())
    assert index.num_blocks("w") == 0
    index.check_integrity()


def test_a_vllm_run_goes_on_the_model_grid_by_tokens():
    """32-token vLLM blocks on a 16-token grid: 2 vLLM blocks are 4 grid blocks, each with its vLLM block's tier;
    48-token blocks on a 32-token grid: 3 blocks = 144 tokens = 4 grid blocks (the partial fifth is not counted),
    each taking the tier of the vLLM block that holds its last token."""
    assert _on_grid({0: 1, 1: 2}, 32, 16) == {0: 1, 1: 1, 2: 2, 3: 2}
    assert _on_grid({0: 1, 1: 1, 2: 4, 4: 1}, 48, 32) == {0: 1, 1: 1, 2: 1, 3: 4}
    assert _on_grid({1: 1}, 16, 16) == {}


def test_vllm_match_hashes_each_worker_in_its_own_space():
    tokens = list(range(3, 3 + 96))
    a = VllmWorkerSpec("http://a:1", "tcp://a:2", id="a", hashing=VllmHashConfig(16, "sha256_cbor"))
    b = VllmWorkerSpec("http://b:1", "tcp://b:2", id="b", hashing=VllmHashConfig(32, "sha256"),
                       loras=(("sql", "/p"),))
    index = PrefixIndex()
    index.add_blocks("a", vllm_block_keys(a.hashing, tokens)[:4], "GPU")
    index.add_blocks("b", vllm_block_keys(b.hashing, tokens, VllmRequestKeys("salt", ("sql", "/p"))), "CPU")
    match = vllm_match(index, [a, b], tokens, "", None, 16)
    assert match.for_worker("a").tier_run("device") == 4 and "b" not in match.local  # b's blocks carry the LoRA
    match = vllm_match(index, [a, b], tokens, "salt", "sql", 16)
    assert match.for_worker("b").tier_run("host") == 6 and "a" not in match.local  # a serves no such adapter
    assert match.num_query_blocks == 6 and match.shared_masks == (0,) * 6


def test_a_registration_names_what_is_wrong():
    with pytest.raises(ValueError, match="url must be"):
        VllmWorkerSpec("localhost:8000", "tcp://h:1")
    with pytest.raises(ValueError, match="events must be"):
        VllmWorkerSpec("http://h:8000", "h:5557")
    with pytest.raises(ValueError, match="unknown field 'hash'"):
        VllmWorkerSpec.from_json({"url": "http://h:1", "events": "tcp://h:2", "hash": "x"})
    with pytest.raises(ValueError, match="kind must be one of"):
        VllmWorkerSpec.from_json({"kind": "strata", "url": "http://h:1", "events": "tcp://h:2"})
    spec = VllmWorkerSpec.from_json({"url": "http://h:8000/", "events": "tcp://h:2", "loras": {"sql": "/p"},
                                     "block_size": 32, "hash_algo": "xxhash", "hash_seed": 0})
    assert (spec.id, spec.hashing, spec.lora_path("sql")) == ("vllm-h:8000", VllmHashConfig(32, "xxhash", "0"), "/p")
    assert VllmWorkerSpec.from_json(spec.to_json()) == spec
