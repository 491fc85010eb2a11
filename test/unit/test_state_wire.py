"""F3 per-component MoRI state wire: round trips, old-format refusal, fuzzing."""

import random
import struct
import tracemalloc

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_disagg_ext.core.state_wire import (
    MAX_COMPONENTS,
    MAX_INTS_BYTES,
    StateWireError,
    WIRE_MAGIC,
    decode_ints_per_component,
    decode_mem_descs_per_component,
    decode_state_indices,
    encode_ints_per_component,
    encode_mem_descs_per_component,
    encode_state_indices,
)

DECODERS = (decode_state_indices, decode_ints_per_component, decode_mem_descs_per_component)

int32s = st.integers(-(2**31), 2**31 - 1)
state_indices_st = st.none() | st.lists(
    st.none() | st.lists(int32s, max_size=50), max_size=16
)
ints_st = st.lists(st.lists(st.integers(0, 2**63 - 1), max_size=40), max_size=16)
descs_st = st.lists(st.lists(st.none() | st.binary(max_size=64), max_size=20), max_size=16)


# --- round trips ------------------------------------------------------------------


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(state_indices_st)
def test_state_indices_round_trip(state):
    got = decode_state_indices(encode_state_indices(state))
    if state is None:
        assert got is None
        return
    assert len(got) == len(state)
    for want, arr in zip(state, got):
        if want is None:
            assert arr is None
        else:
            assert arr.dtype == np.int32 and arr.flags.writeable
            assert arr.tolist() == want


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(st.lists(st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=30), max_size=8))
def test_state_indices_numpy_inputs(state):
    arrays = [None if c is None else np.asarray(c, dtype=np.int64) for c in state]
    got = decode_state_indices(encode_state_indices(arrays))
    assert [None if a is None else a.tolist() for a in got] == state


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(ints_st)
def test_ints_per_component_round_trip(lists):
    assert decode_ints_per_component(encode_ints_per_component(lists)) == lists


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(descs_st)
def test_mem_descs_per_component_round_trip(descs):
    assert decode_mem_descs_per_component(encode_mem_descs_per_component(descs)) == descs


# --- golden encodings (fixed bytes) ------------------------------------------------------
#
# Written by hand from docs/mori.md ("Wire format") and the msgpack spec, never produced by the
# code under test: 53 44 57 c1 = magic b"SDW\xc1", 01 = version 1 (the only version), then the
# kind byte (49 "I" state indices, 4c "L" per-component ints, 44 "D" memory descriptors), then
# the msgpack body. msgpack: c0 nil; 9N fixarray of N; c4 LL bin8, c5 HHLL bin16; 00-7f
# positive fixint; cc uint8, cd uint16, ce uint32, cf uint64 (big-endian, smallest that fits).
# Indices are int32 little-endian inside bin. A change on either side that a round trip would
# not notice (a mixed-version peer) breaks these.

V1 = "53 44 57 c1 01"
# Indices 0..63 as int32 LE: 256 bytes, so the bin16 header c5 01 00.
INDICES_0_TO_63 = " ".join(f"{i:02x} 00 00 00" for i in range(64))

GOLDEN_STATE_INDICES = [
    # no state at all: nil body
    (None, V1 + " 49 c0"),
    # zero components
    ([], V1 + " 49 90"),
    # [3, 7], component missing, empty component
    ([[3, 7], None, []], V1 + " 49 93 c4 08 03 00 00 00 07 00 00 00 c0 c4 00"),
    # int32 extremes: -1, -2**31, 2**31 - 1
    ([[-1, -(2**31), 2**31 - 1]], V1 + " 49 91 c4 0c ff ff ff ff 00 00 00 80 ff ff ff 7f"),
    # a bin16-sized component
    ([list(range(64))], V1 + " 49 91 c5 01 00 " + INDICES_0_TO_63),
]

GOLDEN_INTS = [
    ([], V1 + " 4c 90"),
    # item lengths 96, 32 | 128, 4096 | nothing (a component with no tensors)
    ([[96, 32], [128, 4096], []], V1 + " 4c 93 92 60 20 92 cc 80 cd 10 00 90"),
    # width boundaries: 127 fixint, 255 uint8, 65535 uint16, 65536 uint32, 2**32 and 2**63 - 1 uint64
    (
        [[0, 127, 255, 65535], [65536, 2**32, 2**63 - 1]],
        V1 + " 4c 92 94 00 7f cc ff cd ff ff 93 ce 00 01 00 00 cf 00 00 00 01 00 00 00 00"
        " cf 7f ff ff ff ff ff ff ff",
    ),
]

GOLDEN_MEM_DESCS = [
    ([], V1 + " 44 90"),
    # one packed descriptor and an unregistered zero-length tensor | a component with none
    ([[b"\x01\x02", None], []], V1 + " 44 92 92 c4 02 01 02 c0 90"),
    # an empty packed descriptor stays bytes (c4 00), distinct from nil
    ([[b"", b"\xc1"]], V1 + " 44 91 92 c4 00 c4 01 c1"),
]


def _b(hex_text: str) -> bytes:
    return bytes.fromhex(hex_text)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value,hex_text", GOLDEN_STATE_INDICES)
def test_state_indices_golden(value, hex_text):
    assert encode_state_indices(value) == _b(hex_text)
    got = decode_state_indices(_b(hex_text))
    if value is None:
        assert got is None
    else:
        assert [None if a is None else a.tolist() for a in got] == value
        assert all(a is None or a.dtype == np.int32 for a in got)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value,hex_text", GOLDEN_INTS)
def test_ints_per_component_golden(value, hex_text):
    assert encode_ints_per_component(value) == _b(hex_text)
    assert decode_ints_per_component(_b(hex_text)) == value


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value,hex_text", GOLDEN_MEM_DESCS)
def test_mem_descs_per_component_golden(value, hex_text):
    assert encode_mem_descs_per_component(value) == _b(hex_text)
    assert decode_mem_descs_per_component(_b(hex_text)) == value


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "hex_text,decode",
    [
        # version byte 02: a future peer, refused by name, not misread as v1
        ("53 44 57 c1 02 49 c0", decode_state_indices),
        ("53 44 57 c1 02 4c 90", decode_ints_per_component),
        ("53 44 57 c1 02 44 90", decode_mem_descs_per_component),
    ],
)
def test_golden_header_with_another_version_refused(hex_text, decode):
    with pytest.raises(StateWireError, match="state wire version 2 from peer; this side speaks 1"):
        decode(_b(hex_text))


@pytest.mark.timeout(10)
def test_missing_component_distinct_from_empty():
    got = decode_state_indices(encode_state_indices([None, [], [4]]))
    assert got[0] is None
    assert got[1] is not None and got[1].size == 0
    assert got[2].tolist() == [4]
    assert decode_state_indices(encode_state_indices(None)) is None
    assert decode_state_indices(encode_state_indices([])) == []
    assert encode_state_indices([None]) != encode_state_indices([[]])


@pytest.mark.timeout(10)
def test_payload_kinds_are_not_interchangeable():
    ints = encode_ints_per_component([[1, 2]])
    with pytest.raises(StateWireError, match="expected a state-indices payload, got a per-component-ints one"):
        decode_state_indices(ints)
    with pytest.raises(StateWireError, match="expected a per-component-memory-descriptors payload"):
        decode_mem_descs_per_component(ints)


@pytest.mark.timeout(10)
def test_accepts_bytearray_and_memoryview():
    blob = encode_ints_per_component([[5], [6, 7]])
    assert decode_ints_per_component(bytearray(blob)) == [[5], [6, 7]]
    assert decode_ints_per_component(memoryview(blob)) == [[5], [6, 7]]


# --- old formats: refused with a clear message ---------------------------------------


def _old_flat_state_indices(values):
    # SGLang 0.5.12.post1 MoriKVReceiver.send_metadata: np.int32 array .tobytes()
    return np.asarray(values, dtype=np.int32).tobytes()


def _old_flat_uint32s(values):
    # 0.5.12.post1 _register_kv_args: b"".join(struct.pack("I", v) for v in ...)
    return b"".join(struct.pack("I", v) for v in values)


def _old_flat_descs(descs):
    # 0.5.12.post1 _pack_mem_desc_list: msgpack list of MemoryDesc.pack() bytes
    return msgspec.msgpack.encode(list(descs))


def _upstream_unversioned_int_lists(lists):
    # The little-endian count / lengths / payload layout upstream adopted later.
    blobs = [struct.pack(f"<{len(a)}i", *a) for a in lists]
    return struct.pack(f"<{len(blobs) + 1}I", len(blobs), *map(len, blobs)) + b"".join(blobs)


OLD_PAYLOADS = [
    (b"", "empty payload"),
    (_old_flat_state_indices([3, 4, 5]), "raw 32-bit int array"),
    (_old_flat_state_indices([0]), "raw 32-bit int array"),
    (_old_flat_uint32s([4096, 8192]), "raw 32-bit int array"),
    (_old_flat_descs([b"\x01desc-a", b"\x02desc-b"]), "bare msgpack list"),
    (_old_flat_descs([b"x"] * 20), "bare msgpack list"),
    (msgspec.msgpack.encode([[b"a"], [b"b", None]]), "bare msgpack list"),
    (_upstream_unversioned_int_lists([[1, 2], [3]]), "unversioned pack_int_lists"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("payload,what", OLD_PAYLOADS)
@pytest.mark.parametrize("decode", DECODERS, ids=lambda f: f.__name__)
def test_old_flat_format_refused(payload, what, decode):
    with pytest.raises(StateWireError, match=f"refusing .*{what}.*state wire v1"):
        decode(payload)


@pytest.mark.timeout(10)
def test_magic_is_no_plausible_old_value():
    # As a little-endian int32 state index the magic is negative; as a uint32
    # item length it is over 3 GB; as msgpack it is a fixint, not a list.
    assert struct.unpack("<i", WIRE_MAGIC)[0] < 0
    assert struct.unpack("<I", WIRE_MAGIC)[0] > 3 * 10**9
    assert WIRE_MAGIC[0] < 0x80


@pytest.mark.timeout(10)
def test_other_version_refused():
    blob = bytearray(encode_ints_per_component([[1]]))
    blob[len(WIRE_MAGIC)] = 2
    with pytest.raises(StateWireError, match="state wire version 2 from peer; this side speaks 1"):
        decode_ints_per_component(bytes(blob))


# --- bounds ------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_encode_rejects_bad_input():
    with pytest.raises(StateWireError, match="exceed the cap of 64"):
        encode_state_indices([[1]] * (MAX_COMPONENTS + 1))
    with pytest.raises(StateWireError, match="indices must be integers"):
        encode_state_indices([[1.5]])
    with pytest.raises(StateWireError, match="index outside int32"):
        encode_state_indices([[2**31]])
    with pytest.raises(StateWireError, match="ints must be in"):
        encode_ints_per_component([[-1]])
    with pytest.raises(StateWireError, match="expected a list of ints"):
        encode_ints_per_component([[True]])
    with pytest.raises(StateWireError, match="expected a list of ints"):
        encode_ints_per_component([None])
    with pytest.raises(StateWireError, match="expected packed bytes"):
        encode_mem_descs_per_component([["not-bytes"]])
    with pytest.raises(StateWireError, match="expected a list per component"):
        encode_mem_descs_per_component(b"flat")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("decode", DECODERS, ids=lambda f: f.__name__)
def test_decode_rejects_non_bytes(decode):
    for bad in (None, "text", 12, [b"x"]):
        with pytest.raises(StateWireError, match="must be bytes"):
            decode(bad)


def _header(kind: bytes) -> bytes:
    return WIRE_MAGIC + b"\x01" + kind


FORGED = [
    (_header(b"I") + b"\xdd\xff\xff\xff\xff", "exceed the cap"),  # 4G components
    (_header(b"I") + b"\xdc\xff\xff", "exceed the cap"),
    (_header(b"I") + b"\x91\xc6\xff\xff\xff\xff", "truncated"),  # 4 GB bin
    (_header(b"L") + b"\x91\xdd\x7f\xff\xff\xff", "truncated"),  # 2G ints
    (_header(b"D") + b"\x91\xdd\x7f\xff\xff\xff\xc0", "truncated"),  # 2G descs
    (_header(b"D") + b"\x91\x91\xc6\x7f\xff\xff\xff", "truncated"),
    (_header(b"L") + b"\xdf\xff\xff\xff\xff", "malformed"),  # a map, not a list
    (_header(b"L") + b"\x91" * 200000, "malformed"),  # deep nesting
    (_header(b"D") + b"\x91" * 1000, "malformed"),
    (_header(b"L") + b"\x90" * (MAX_INTS_BYTES + 1), "exceeds the"),  # oversize input
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("payload,pattern", FORGED)
def test_forged_lengths_refused_without_big_allocation(payload, pattern):
    decode = {
        b"I": decode_state_indices,
        b"L": decode_ints_per_component,
        b"D": decode_mem_descs_per_component,
    }[payload[len(WIRE_MAGIC) + 1 : len(WIRE_MAGIC) + 2]]
    tracemalloc.start()
    try:
        with pytest.raises(StateWireError, match=pattern):
            decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(payload) + (1 << 20), peak


# --- fuzz ----------------------------------------------------------------------------


def _random_valid(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    ncomp = rng.randrange(0, 6)
    if kind == 0:
        if rng.random() < 0.05:
            return encode_state_indices(None)
        return encode_state_indices(
            [
                None if rng.random() < 0.2 else [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 12))]
                for _ in range(ncomp)
            ]
        )
    if kind == 1:
        return encode_ints_per_component(
            [[rng.randrange(0, 2 ** rng.choice((7, 16, 33, 63))) for _ in range(rng.randrange(0, 8))] for _ in range(ncomp)]
        )
    return encode_mem_descs_per_component(
        [
            [None if rng.random() < 0.1 else rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(0, 5))]
            for _ in range(ncomp)
        ]
    )


_FORGED_HEADERS = [
    b"\xdd\xff\xff\xff\xff",
    b"\xdd\x7f\xff\xff\xff",
    b"\xdc\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xc6\x7f\xff\xff\xff",
    b"\xc5\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc9\xff\xff\xff\xff\x01",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
]


def _mutate(rng: random.Random, blob: bytes) -> bytes:
    op = rng.randrange(8)
    data = bytearray(blob)
    if op == 0 and data:  # bit flips
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncation
        del data[rng.randrange(len(data) + 1) :]
    elif op == 2:  # random bytes appended
        data += rng.randbytes(rng.randrange(1, 16))
    elif op == 3:  # forged length header spliced in
        i = rng.randrange(len(data) + 1)
        data[i:i] = rng.choice(_FORGED_HEADERS)
    elif op == 4 and len(data) > 6:  # forged header overwriting the body
        i = rng.randrange(6, len(data))
        forged = rng.choice(_FORGED_HEADERS)
        data[i : i + len(forged)] = forged
    elif op == 5:  # valid header, random body
        data = bytearray(blob[:6] + rng.randbytes(rng.randrange(0, 48)))
    elif op == 6 and data:  # byte replaced
        data[rng.randrange(len(data))] = rng.randrange(256)
    else:  # pure random bytes, sometimes with the magic in front
        prefix = WIRE_MAGIC if rng.random() < 0.5 else b""
        data = bytearray(prefix + rng.randbytes(rng.randrange(0, 64)))
    return bytes(data)


@pytest.mark.timeout(240)
def test_fuzz_only_state_wire_error():
    """Every mutated message decodes or raises StateWireError, and no decode allocates more
    than a small multiple of its input: a length field is never trusted for an allocation.
    (Memory, measured by tracemalloc, is deterministic; time would be noise.)"""
    rng = random.Random(0xF3)
    n_inputs = 12000
    worst = (0, 0)  # (peak bytes allocated by one decode, its input length)
    accepted = 0
    tracemalloc.start()
    try:
        for n in range(n_inputs):
            blob = _random_valid(rng)
            if n % 10:  # one in ten stays valid, to keep the decoders honest
                blob = _mutate(rng, blob)
                if rng.random() < 0.3:
                    blob = _mutate(rng, blob)
            for decode in DECODERS:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                try:
                    decode(blob)
                    accepted += 1
                except StateWireError:
                    pass
                # Any other exception type propagates and fails the test.
                peak = tracemalloc.get_traced_memory()[1] - base
                worst = max(worst, (peak, len(blob)))
    finally:
        tracemalloc.stop()
    # Decoded lists of Python ints cost ~36 bytes per encoded byte at most; 64 KiB covers
    # the bookkeeping of one decode. A trusted length field would allocate megabytes.
    assert worst[0] <= 64 * 1024 + 64 * worst[1], f"one decode allocated {worst[0]} bytes for {worst[1]} input bytes"
    assert accepted > n_inputs // 10  # the valid tenth decodes with its own decoder
