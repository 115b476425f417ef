"""The router's vLLM block hashes equal vLLM's own (issue 18 item 2): token sequences hashed by vLLM's request block
hasher, from its published wheel (`tests/vllm_wheel.py`), under every hash algorithm, seed, block size, cache salt
and LoRA adapter, against `router.vllm_hashing`."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from router.vllm_hashing import (HASH_ALGOS, VllmHashConfig, VllmRequestKeys, event_key, vllm_block_hashes,
                                 vllm_block_keys)
from tests.vllm_wheel import vllm  # noqa: F401  (the session fixture)


def make_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n)]


def make_request(tokens: list[int], keys: VllmRequestKeys) -> SimpleNamespace:
    """What vLLM's request block hasher reads of a `vllm.v1.request.Request` (a text prompt: no multimodal input,
    no prompt embeddings)."""
    lora = None if keys.lora is None else SimpleNamespace(lora_name=keys.lora[0], lora_path=keys.lora[1])
    return SimpleNamespace(block_hashes=[], num_tokens=len(tokens), mm_features=[], _all_token_ids=tokens,
                           all_token_ids=tokens, lora_request=lora, cache_salt=keys.cache_salt or None,
                           prompt_embeds=None, _prompt_embeds_per_block_hashes={})


def vllm_hashes(vllm, config: VllmHashConfig, tokens: list[int], keys: VllmRequestKeys, monkeypatch) -> list:
    """vLLM's hashes of the prompt, as its engine computes them at admission (NONE_HASH set at start)."""
    if config.hash_seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", config.hash_seed)
    hash_fn = vllm.hashing.get_hash_fn_by_name(config.hash_algo)
    vllm.kv_cache_utils.init_none_hash(hash_fn)
    hasher = vllm.kv_cache_utils.get_request_block_hasher(config.block_size, hash_fn)
    return hasher(make_request(tokens, keys))


KEYS = [VllmRequestKeys(), VllmRequestKeys(cache_salt="tenant-a"), VllmRequestKeys(lora=("sql-lora", "/adapters/sql")),
        VllmRequestKeys(cache_salt="tenant-b", lora=("sql-lora", "/adapters/sql"))]


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_router_hashes_equal_vllms_for_every_algorithm_and_block_size(vllm, monkeypatch, algo, block_size):
    config = VllmHashConfig(block_size, algo, "1234" if algo.startswith("xxhash") else None)
    for i, keys in enumerate(KEYS):
        tokens = make_tokens(i, 7 * block_size + 3)  # a partial last block: not hashed, by either
        theirs = vllm_hashes(vllm, config, tokens, keys, monkeypatch)
        assert len(theirs) == 7
        assert vllm_block_hashes(config, tokens, keys) == theirs
        published = [vllm.kv_cache_utils.maybe_convert_block_hash(h) for h in theirs]
        assert vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES  # vLLM's default: events carry the low 64 bits
        assert vllm_block_keys(config, tokens, keys) == published
        assert [event_key(h) for h in theirs] == published  # a worker publishing digests is keyed the same


def test_a_seed_changes_every_hash_as_vllms_pythonhashseed_does(vllm, monkeypatch):
    tokens = make_tokens(9, 64)
    default, seeded = VllmHashConfig(16, "sha256"), VllmHashConfig(16, "sha256", "7")
    assert vllm_block_hashes(seeded, tokens) == vllm_hashes(vllm, seeded, tokens, VllmRequestKeys(), monkeypatch)
    assert not set(vllm_block_hashes(default, tokens)) & set(vllm_block_hashes(seeded, tokens))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert default.none_hash == vllm.none_hash("sha256")  # vLLM's fixed default seed, "vllm-none-hash"


def test_salt_keys_only_the_first_block_and_lora_every_block():
    """vLLM's extra keys: the cache salt on block 0 (the chain carries it on), a LoRA adapter on every block."""
    keys = VllmRequestKeys(cache_salt="s", lora=("a", "/p"))
    assert keys.for_block(0) == (("lora", "a", "/p"), ("cache_salt", "s"))
    assert keys.for_block(3) == (("lora", "a", "/p"),)
    assert VllmRequestKeys().for_block(0) is None


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="hash_algo must be one of"):
        VllmHashConfig(16, "md5")
    with pytest.raises(ValueError, match="needs hash_seed"):
        VllmHashConfig(16, "xxhash")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        VllmHashConfig(0)
