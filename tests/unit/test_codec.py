"""Block codec: round trips, and every way a stored block can be wrong is caught and named."""
from __future__ import annotations

import struct

import pytest
import xxhash

from kvstore import codec
from kvstore.codec import HEADER_SIZE, BlockLayout, CorruptBlock
from kvstore.hashing import Namespace, hash_blocks

NS = Namespace("tiny-llama@abc", "bs4-l2-h2-d8", "float16")
FP = NS.fingerprint()
LAYOUT = BlockLayout(num_layers=2, block_size=4, kv_heads=2, head_dim=8)
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
H0, H1 = hash_blocks(NS, TOKENS, 4)
PAYLOAD = bytes((i * 7) % 251 for i in range(LAYOUT.payload_bytes("float16")))


SCALES = struct.pack("<8f", *[0.5 + i for i in range(8)])     # float32 [layers 2, K/V 2, kv_heads 2]
Q_PAYLOAD = bytes((i * 5) % 256 for i in range(LAYOUT.payload_bytes("int8")))


def make_block(**options) -> bytearray:
    options.setdefault("tokens", TOKENS[4:])
    options.setdefault("parent_hash", H0)
    return bytearray(codec.encode(FP, H1, LAYOUT, "float16", PAYLOAD, **options))


def make_quantized(dtype: str) -> bytearray:
    return bytearray(codec.encode(FP, H1, LAYOUT, dtype, Q_PAYLOAD, scales=SCALES, tokens=TOKENS[4:],
                                  parent_hash=H0))


def reseal(buf: bytearray) -> bytearray:
    """Recompute the header checksum after editing header fields, so only the edited field is wrong."""
    body = HEADER_SIZE - 8
    buf[body:HEADER_SIZE] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:body])))
    return buf


def expect_corrupt(buf, reason: str, **kwargs) -> None:
    with pytest.raises(CorruptBlock) as info:
        codec.decode(buf, kwargs.get("fp", FP), kwargs.get("h", H1), kwargs.get("layout"))
    assert info.value.reason == reason, str(info.value)


def test_round_trip_returns_every_field_and_zero_copy_views():
    buf = make_block()
    block = codec.decode(buf, FP, H1, LAYOUT)
    assert block.header.fingerprint == FP and block.header.block_hash == H1 and block.header.parent_hash == H0
    assert block.header.layout == LAYOUT and block.header.dtype == "float16" and block.header.num_tokens == 4
    assert list(block.tokens) == TOKENS[4:]
    assert bytes(block.scales) == b"" and block.header.scales_len == 0
    assert bytes(block.payload) == PAYLOAD == bytes(block.span)
    assert len(buf) == codec.encoded_size(len(PAYLOAD), 0, 4) == block.header.encoded_len
    buf[-1] ^= 0xFF  # the payload view aliases the buffer: no copy was made
    assert block.payload[-1] == buf[-1]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_quantized_block_carries_its_scales_right_before_the_payload(dtype):
    """A quantized block's scales and payload sections are one span `scales | values`, as the engine keeps it."""
    buf = make_quantized(dtype)
    block = codec.decode(buf, FP, H1, LAYOUT)
    assert block.header.dtype == dtype and block.header.scales_len == LAYOUT.scale_bytes(dtype) == 2 * 2 * 2 * 4
    assert bytes(block.scales) == SCALES and bytes(block.payload) == Q_PAYLOAD
    assert bytes(block.span) == SCALES + Q_PAYLOAD and len(block.span) == LAYOUT.span_bytes(dtype)
    assert len(buf) == codec.encoded_size(len(Q_PAYLOAD), len(SCALES), 4) == block.header.encoded_len


def test_scale_bytes_only_for_quantized_dtypes():
    assert LAYOUT.scale_bytes("float8_e4m3fn") == LAYOUT.scale_bytes("int8") == 2 * 2 * 2 * 4
    assert [LAYOUT.scale_bytes(d) for d in ("float32", "bfloat16", "float16", "float8_e5m2", "uint8")] == [0] * 5
    assert LAYOUT.span_bytes("int8") == 32 + LAYOUT.payload_bytes("int8") == 32 + 2 * 2 * 4 * 2 * 8
    with pytest.raises(ValueError, match="dtype must be one of"):
        LAYOUT.scale_bytes("float64")


@pytest.mark.parametrize("dtype, scales", [("int8", b""), ("int8", SCALES[:-4]), ("float8_e4m3fn", SCALES + b"\0" * 4),
                                           ("float16", b"\x01\x02\x03\x04")])
def test_encode_requires_exactly_the_scales_the_dtype_has(dtype, scales):
    payload = Q_PAYLOAD if dtype != "float16" else PAYLOAD
    with pytest.raises(ValueError, match=f"scales are {len(scales)} bytes"):
        codec.encode(FP, H1, LAYOUT, dtype, payload, scales=scales)


def test_scales_length_that_does_not_fit_the_dtype_is_a_length_error():
    """A header whose scales length is not the dtype's (edited, or another dtype of the same width) is refused."""
    short = make_quantized("int8")
    expect_corrupt(reseal(_set(short, 80, "<I", len(SCALES) - 4)), "length")
    as_uint8 = make_quantized("int8")   # uint8 values are as wide as int8 but carry no scales
    expect_corrupt(reseal(_set(as_uint8, 8, "<B", codec.DTYPE_CODES["uint8"])), "length")


def test_round_trip_without_tokens_or_parent():
    buf = codec.encode(FP, H0, LAYOUT, "float16", PAYLOAD, num_tokens=3)
    block = codec.decode(buf, FP, H0)
    assert block.header.parent_hash is None and block.header.num_tokens == 3 and len(block.tokens) == 0
    assert len(buf) == HEADER_SIZE + len(PAYLOAD)


def test_encode_into_a_larger_buffer_and_decode_the_prefix():
    out = bytearray(HEADER_SIZE + len(PAYLOAD) + 100)
    n = codec.encode_into(out, FP, H1, LAYOUT, "float16", memoryview(PAYLOAD))
    assert n == HEADER_SIZE + len(PAYLOAD)
    assert bytes(codec.decode(out, FP, H1).payload) == PAYLOAD
    assert HEADER_SIZE % 64 == 0  # sections after the header stay aligned


@pytest.mark.parametrize("bad, message", [
    (dict(payload=b"\x00" * 10), "payload is 10 bytes"),
    (dict(fingerprint=b"short"), "fingerprint must be 16 bytes"),
    (dict(tokens=[1, 2, 3, 4, 5]), "num_tokens must be in [0, 4]"),
    (dict(dtype="float64"), "dtype must be one of"),
])
def test_encode_rejects_bad_arguments_naming_them(bad, message):
    args = dict(fingerprint=FP, block_hash=H1, layout=LAYOUT, dtype="float16", payload=PAYLOAD)
    args.update(bad)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        codec.encode(args.pop("fingerprint"), args.pop("block_hash"), args.pop("layout"), args.pop("dtype"),
                     args.pop("payload"), **args)


def test_truncated_header_and_truncated_payload():
    buf = make_block()
    expect_corrupt(buf[:HEADER_SIZE - 1], "truncated")
    expect_corrupt(buf[:-1], "truncated")
    expect_corrupt(b"", "truncated")


def test_wrong_magic():
    buf = make_block()
    buf[0:4] = b"XXXX"
    expect_corrupt(buf, "magic")


def test_unknown_version():
    expect_corrupt(reseal(_set(make_block(), 4, "<H", 99)), "version")


def test_flipped_header_bit_fails_the_header_checksum():
    buf = make_block()
    buf[40] ^= 0x01  # inside the block hash
    expect_corrupt(buf, "header_checksum")


def test_unknown_checksum_algorithm_dtype_and_flags():
    expect_corrupt(reseal(_set(make_block(), 6, "<B", 9)), "checksum_algo")
    expect_corrupt(reseal(_set(make_block(), 8, "<B", 200)), "dtype")
    expect_corrupt(reseal(_set(make_block(), 9, "<B", 0x80)), "flags")


def test_other_namespace_is_refused():
    expect_corrupt(make_block(), "fingerprint", fp=NS.with_salt("tenant-b").fingerprint())


def test_other_block_hash_is_refused():
    expect_corrupt(make_block(), "hash", h=H0)


def test_unexpected_layout_is_refused():
    expect_corrupt(make_block(), "layout", layout=BlockLayout(2, 4, 2, 16))


def test_zero_layout_field_is_refused():
    expect_corrupt(reseal(_set(make_block(), 60, "<I", 0)), "layout")  # num_layers


def test_payload_length_that_does_not_fit_the_layout():
    expect_corrupt(reseal(_set(make_block(), 84, "<Q", len(PAYLOAD) - 2)), "length")


def test_token_count_above_block_size():
    expect_corrupt(reseal(_set(make_block(tokens=None, num_tokens=4, parent_hash=None), 76, "<I", 5)), "length")


@pytest.mark.parametrize("where", ["token", "scale", "payload_first", "payload_last"])
def test_flipped_bit_in_any_section_fails_the_checksum(where):
    buf = make_quantized("float8_e4m3fn")
    offset = {"token": HEADER_SIZE, "scale": HEADER_SIZE + 16, "payload_first": HEADER_SIZE + 16 + len(SCALES),
              "payload_last": len(buf) - 1}[where]
    buf[offset] ^= 0x10
    expect_corrupt(buf, "payload_checksum")


def test_peek_header_reads_metadata_without_the_payload():
    buf = make_block()
    header = codec.peek_header(buf[:HEADER_SIZE])
    assert header.block_hash == H1 and header.payload_len == len(PAYLOAD)
    assert codec.read_tokens(buf, header) == TOKENS[4:]


def test_no_pickle_in_the_codec_module():
    import inspect
    assert "pickle" not in inspect.getsource(codec).replace("No pickle", "")


def _set(buf: bytearray, offset: int, fmt: str, value: int) -> bytearray:
    struct.pack_into(fmt, buf, offset, value)
    return buf


def _run_of_blocks(n: int) -> tuple[list[bytes], list[bytearray]]:
    """n blocks of one prefix (the first without a parent), each in a buffer with slack after it."""
    tokens = list(range(100, 100 + 4 * n))
    hashes = hash_blocks(NS, tokens, 4)
    bufs = []
    for i, block_hash in enumerate(hashes):
        payload = bytes((i + j * 3) % 256 for j in range(len(PAYLOAD)))
        bufs.append(bytearray(codec.encode(FP, block_hash, LAYOUT, "float16", payload, tokens=tokens[4 * i:4 * i + 4],
                                           parent_hash=hashes[i - 1] if i else None)) + bytearray(13))
    return hashes, bufs


def _same_verdicts(views, hashes, layout=None) -> list:
    many = codec.decode_many(views, FP, hashes, layout)
    assert len(many) == len(views)
    for view, block_hash, got in zip(views, hashes, many):
        try:
            want = codec.decode(view, FP, block_hash, layout)
        except CorruptBlock as exc:
            assert isinstance(got, CorruptBlock) and got.reason == exc.reason, (got, exc.reason)
            continue
        assert isinstance(got, codec.DecodedBlock) and got.header == want.header
        for part in ("tokens", "scales", "payload", "span"):
            assert bytes(getattr(got, part)) == bytes(getattr(want, part)), part
    return many


@pytest.mark.parametrize("damage", ["none", "payload_bit", "header_bit", "hash", "fingerprint", "short_view",
                                    "other_shape", "first_corrupt", "reseal_version", "layout"])
def test_decode_many_gives_decode_s_verdict_for_every_block(damage):
    """The batched check (headers as one array, checksums in one pass) names the same failure as `decode` does
    block by block, for damage anywhere in the run, the first block included; valid blocks of another shape
    (here: one without token ids) still decode."""
    hashes, bufs = _run_of_blocks(6)
    views = [memoryview(b) for b in bufs]
    if damage == "payload_bit":
        bufs[3][-20] ^= 0x04
    elif damage == "header_bit":
        bufs[2][45] ^= 0x01
    elif damage == "hash":
        hashes = [*hashes[:4], hashes[0], hashes[5]]
    elif damage == "fingerprint":
        bufs[1] = bytearray(codec.encode(NS.with_salt("t").fingerprint(), hashes[1], LAYOUT, "float16", PAYLOAD,
                                         tokens=[1, 2, 3, 4]))
        views[1] = memoryview(bufs[1])
    elif damage == "short_view":
        views[4] = views[4][:HEADER_SIZE + 10]
    elif damage == "other_shape":
        bufs[2] = bytearray(codec.encode(FP, hashes[2], LAYOUT, "float16", PAYLOAD, num_tokens=4))
        views[2] = memoryview(bufs[2])
    elif damage == "first_corrupt":
        bufs[0][HEADER_SIZE + 3] ^= 0x80
    elif damage == "reseal_version":
        reseal(_set(bufs[5], 4, "<H", 7))
    many = _same_verdicts(views, hashes, BlockLayout(2, 4, 2, 16) if damage == "layout" else LAYOUT)
    bad = {"none": set(), "payload_bit": {3}, "header_bit": {2}, "hash": {4}, "fingerprint": {1}, "short_view": {4},
           "other_shape": set(), "first_corrupt": {0}, "reseal_version": {5}, "layout": set(range(6))}[damage]
    assert {i for i, b in enumerate(many) if isinstance(b, CorruptBlock)} == bad


def test_decode_many_of_quantized_blocks_and_of_nothing():
    assert codec.decode_many([], FP, []) == []
    views = [memoryview(make_quantized("int8")), memoryview(make_quantized("int8"))]
    many = _same_verdicts(views, [H1, H1])
    assert all(bytes(b.scales) == SCALES for b in many)
