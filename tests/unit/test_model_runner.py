"""ModelRunner: the block-major cache, whole-block copy out/in (what the KV store will move), and input checks."""
from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.model_runner import ModelRunner
from engine.config import CacheConfig, ModelConfig

BLOCK = 4


def make_runner(path, num_blocks: int = 16) -> ModelRunner:
    return ModelRunner(ModelConfig(str(path)), CacheConfig(block_size=BLOCK, num_blocks=num_blocks))


def make_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def qwen3_moe(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def test_cache_is_block_major_and_block_bytes_cover_all_layers(qwen3_moe):
    runner = make_runner(qwen3_moe.path)
    # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    assert tuple(runner.kv_cache.shape) == (16, 2, 2, BLOCK, 2, 16)
    assert runner.num_blocks == 16
    assert runner.block_bytes == 2 * 2 * BLOCK * 2 * 16 * 4
    assert runner.fingerprint.startswith("Qwen3MoeForCausalLM/")


def test_prefill_writes_only_its_own_blocks(qwen3_moe):
    runner = make_runner(qwen3_moe.path)
    runner.execute(StepBatch([ScheduledSeq("a", make_tokens(6, 1), 0, [5, 9])]))
    touched = runner.kv_cache.flatten(1).abs().sum(dim=1).nonzero().flatten().tolist()
    assert touched == [5, 9]
    assert runner.kv_cache[9, :, :, 2:].abs().sum() == 0     # positions 6, 7 not written


def test_blocks_moved_to_another_runner_continue_identically(qwen3_moe):
    """Prefill on one runner, copy its blocks out, write them into different block ids of a second runner, and
    decode there: the logits equal decoding on the first runner (the P->D hand-off)."""
    prompt, nxt = make_tokens(10, 2), make_tokens(1, 3)
    prefill, decode = make_runner(qwen3_moe.path), make_runner(qwen3_moe.path)
    prefill.execute(StepBatch([ScheduledSeq("a", prompt, 0, [1, 2, 3])]))
    expected = prefill.execute(StepBatch([ScheduledSeq("a", nxt, 10, [1, 2, 3])]))
    blocks = prefill.read_blocks([1, 2, 3])
    assert blocks.is_contiguous() and blocks.shape == (3, *prefill.kv_cache.shape[1:])
    decode.write_blocks([7, 4, 12], blocks)
    got = decode.execute(StepBatch([ScheduledSeq("a", nxt, 10, [7, 4, 12])]))
    assert torch.equal(got, expected)


def test_write_blocks_rejects_wrong_shape_and_ids(qwen3_moe):
    runner = make_runner(qwen3_moe.path)
    with pytest.raises(ValueError, match="shape"):
        runner.write_blocks([0], torch.zeros(2, *runner.kv_cache.shape[1:]))
    with pytest.raises(ValueError, match=r"block_ids must be in \[0, 16\)"):
        runner.read_blocks([16])


def test_short_block_table_and_bad_num_logits_are_rejected(qwen3_moe):
    runner = make_runner(qwen3_moe.path)
    with pytest.raises(ValueError, match="block_table has 1 blocks, needs 2"):
        runner.execute(StepBatch([ScheduledSeq("a", make_tokens(5, 4), 0, [0])]))
    with pytest.raises(ValueError, match=r"num_logits must be in \[0, 2\]"):
        runner.execute(StepBatch([ScheduledSeq("a", make_tokens(2, 4), 0, [0], num_logits=3)]))


def test_empty_batch_gives_no_logits(qwen3_moe):
    assert make_runner(qwen3_moe.path).execute(StepBatch([])).shape == (0, 320)


def test_moe_dispatches_agree(qwen3_moe):
    """Gather (few pairs) and grouped (many pairs) expert dispatch compute the same thing."""
    runner = make_runner(qwen3_moe.path)
    experts = runner.model.layers[0].mlp.experts
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 1], [3, 2], [1, 3], [0, 2], [2, 1]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(experts.forward_gather(x, ids, w), experts.forward_grouped(x, ids, w))


@pytest.mark.parametrize("ids", [list(range(5, 13)), [3, 9, 1, 14, 6, 0, 11, 4],
                                 [*range(10, 18), *range(0, 8), *range(20, 28)]],
                         ids=["one run", "scattered", "three runs"])
@pytest.mark.parametrize("row_offset", [16, 4], ids=["16-byte aligned rows", "4-byte aligned rows"])
def test_write_blocks_from_strided_rows_equals_index_copy(ids, row_offset):
    """`write_blocks` copies runs of consecutive ids as slices and scattered ids as one index_copy_ (over 16-byte
    elements where the rows allow it): the cache ends up as a plain index_copy_ leaves it."""
    from engine.kv_cache import KVCache

    cache = KVCache(32, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    cache.tensor.normal_()
    want = cache.tensor.clone()
    span = cache.block_bytes
    staging = torch.randint(0, 255, (len(ids), span + 64), dtype=torch.uint8)  # rows with a header in front
    data = staging[:, row_offset:row_offset + span].view(torch.float32).view(len(ids), *cache.block_shape)
    cache.write_blocks(ids, data)
    want.index_copy_(0, torch.tensor(ids), data)
    assert torch.equal(cache.tensor.view(torch.uint8), want.view(torch.uint8))
