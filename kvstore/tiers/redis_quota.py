"""Per-namespace byte quotas of the Redis tier, counted in Redis itself so that every worker shares one count.

    <key base>quota:<namespace fingerprint hex>     bytes that namespace's blocks take under this key base

A namespace is the fingerprint at offset 12 of every stored object, plain or sealed (`kvstore.sealing`), so the
tenant-salted and the public (salt-free) namespaces are counted apart. Both scripts run atomically on the server:
- `PUT_SCRIPT`: a block already there is a no-op (its TTL renewed); one that would take its namespace past the
  quota is refused (0); else SET and INCRBY of the counter by its length (1).
- `DELETE_SCRIPT`: UNLINK the block and DECRBY its length, only while the block still belongs to that namespace
  (the caller read the fingerprint with GETRANGE first; a block gone meanwhile is not counted twice).

Limits: a key that expires (`ttl_s`) or that Redis evicts (maxmemory policies other than noeviction) does not
give its bytes back, so the count drifts high (conservative: refuses early) until `clear()`, which removes the
counters with the blocks. Cluster mode is refused (a counter and its blocks live in different slots).
"""
from __future__ import annotations

QUOTA_TAG = "quota:"
FINGERPRINT_RANGE = (12, 27)  # inclusive byte range of the fingerprint (GETRANGE)

PUT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[3] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
  return 1
end
local n = string.len(ARGV[1])
if (tonumber(redis.call('GET', KEYS[2])) or 0) + n > tonumber(ARGV[2]) then return 0 end
if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('INCRBY', KEYS[2], n)
return 1
"""

DELETE_SCRIPT = """
if redis.call('GETRANGE', KEYS[1], ARGV[2], ARGV[3]) ~= ARGV[1] then return 0 end
local n = redis.call('STRLEN', KEYS[1])
redis.call('UNLINK', KEYS[1])
if redis.call('DECRBY', KEYS[2], n) < 0 then redis.call('SET', KEYS[2], 0) end
return 1
"""


def usage_key(key_base: str, fingerprint: bytes) -> bytes:
    return f"{key_base}{QUOTA_TAG}{bytes(fingerprint).hex()}".encode()


def put_command(block_key: bytes, usage: bytes, data: bytes | memoryview, quota: int, ttl_ms: int | None) -> tuple:
    return ("EVAL", PUT_SCRIPT, 2, block_key, usage, data, quota, ttl_ms or 0)


def delete_command(block_key: bytes, usage: bytes, fingerprint: bytes) -> tuple:
    return ("EVAL", DELETE_SCRIPT, 2, block_key, usage, fingerprint, *FINGERPRINT_RANGE)
