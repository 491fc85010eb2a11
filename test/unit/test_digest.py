"""core.digest: the verified-transfer digest (frame version 2), checked against values derived by hand.

Expected values come from the definition in ``core/digest.py``'s docstring
(little-endian unsigned 64-bit words, zero-padded tail, odd weights, all mod
2**64), re-derived here with an independent splitmix64 (checked against its
published first output for seed 0), never from the module's own weight functions.
"""

import itertools

import pytest

from sglang_disagg_ext.core import digest as dg

M64 = (1 << 64) - 1


def sm64(z):
    """splitmix64 as published (Steele, Lea, Flood 2014), one step from state ``z``."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def buffer_factor(c, b):
    return sm64((c << 48) ^ (b << 32) ^ 0x5EEDD16E57A10000) | 1


def slot_factor(p):
    return sm64(p ^ 0x5107FAC700000000) | 1


def weight(c, b, p, k):
    """The weight of 64-bit word k of destination item (c, b, p)."""
    return ((sm64(k) | 1) * buffer_factor(c, b) * slot_factor(p)) & M64


@pytest.mark.timeout(10)
def test_splitmix64_matches_published_vector():
    # First output of splitmix64 seeded with 0 (the reference C implementation).
    assert sm64(0) == 0xE220A8397B1DCDAF
    assert dg.splitmix64(0) == 0xE220A8397B1DCDAF
    assert dg.base(0) == 0xE220A8397B1DCDAF  # already odd


@pytest.mark.timeout(10)
def test_small_items_by_hand():
    # Two 8-byte words: 0x0000000000000201 (bytes 01 02 00..) and 0x00000000000000FF; KV buffer 3, page 7.
    data = bytes([0x01, 0x02, 0, 0, 0, 0, 0, 0, 0xFF, 0, 0, 0, 0, 0, 0, 0])
    expected = (0x201 * weight(0, 3, 7, 0) + 0xFF * weight(0, 3, 7, 1)) & M64
    assert dg.item_digest(data, 0, 3, 7) == expected
    # A byte in the 5th position belongs to word 0 (8-byte words): 0x05 * 2**32.
    assert dg.item_digest(bytes([0, 0, 0, 0, 5]), 0, 0, 0) == ((5 << 32) * weight(0, 0, 0, 0)) & M64
    # Word values are unsigned: all-ones is 2**64 - 1, i.e. minus the weight.
    assert dg.item_digest(b"\xff" * 8, 2, 0, 0) == (-weight(2, 0, 0, 0)) & M64
    # Top bit only: 2**63 times an odd weight is 2**63 (mod 2**64), never 0.
    assert dg.item_digest(bytes(7) + b"\x80", 0, 0, 4) == 1 << 63
    # Ten bytes: the last word is bytes 8-9 zero-padded (0x000000000000BBAA).
    ten = bytes([1, 0, 0, 0, 0, 0, 0, 0, 0xAA, 0xBB])
    assert dg.item_digest(ten, 1, 0, 5) == (1 * weight(1, 0, 5, 0) + 0xBBAA * weight(1, 0, 5, 1)) & M64
    assert dg.item_digest(ten, 1, 0, 5) == dg.item_digest(ten + bytes(6), 1, 0, 5)


@pytest.mark.timeout(10)
def test_placement_changes_the_digest():
    data = bytes(range(8))
    at = {(c, b, p): dg.item_digest(data, c, b, p) for c, b, p in itertools.product((0, 1, 2), (0, 1), (0, 1))}
    assert len(set(at.values())) == len(at)


@pytest.mark.timeout(10)
def test_partials_compose_to_the_whole():
    # Two "ranks" each write part of a 24-byte item (a head slice each), cut on a
    # word boundary and inside words: the sum of their partials is the item's digest.
    item = bytes([7 * i + 3 for i in range(24)])
    whole = dg.item_digest(item, 0, 2, 9)
    assert whole == sum(int.from_bytes(item[8 * k:8 * k + 8], "little") * weight(0, 2, 9, k) for k in range(3)) & M64
    for cut in (8, 16, 5, 1, 13, 23):
        parts = [dg.item_digest(item[:cut], 0, 2, 9, offset=0), dg.item_digest(item[cut:], 0, 2, 9, offset=cut)]
        assert dg.combine(parts) == whole
    # Three pieces, the middle one inside word 1 only.
    parts = [dg.item_digest(item[:9], 0, 2, 9), dg.item_digest(item[9:12], 0, 2, 9, offset=9),
             dg.item_digest(item[12:], 0, 2, 9, offset=12)]
    assert dg.combine(parts) == whole


@pytest.mark.timeout(30)
def test_any_single_changed_word_changes_the_digest():
    # Every byte position, every single-bit change and the full-byte flip: the
    # word changes by d != 0 (mod 2**64) and its weight is odd (invertible), so
    # the digest changes by d * w != 0.
    item = bytearray(range(0x30, 0x30 + 20))
    base_digest = dg.item_digest(bytes(item), 0, 0, 1)
    for pos in range(len(item)):
        for mask in [1 << bit for bit in range(8)] + [0xFF]:
            changed = bytearray(item)
            changed[pos] ^= mask
            assert dg.item_digest(bytes(changed), 0, 0, 1) != base_digest, (pos, mask)
    # Every byte of word 1 flipped at once: d = ~x - x = -(2x + 1), odd, so d * w is odd.
    changed = bytearray(item)
    for i in range(8, 16):
        changed[i] ^= 0xFF
    assert dg.item_digest(bytes(changed), 0, 0, 1) != base_digest
    # The smallest-order changes: d = 2**63 (a word's top bit) times an odd weight is 2**63.
    assert (2**63 * weight(0, 0, 1, 2)) & M64 == 2**63


@pytest.mark.timeout(10)
def test_vectors_agree_with_scalars():
    assert [int(x) for x in dg.base_vector(5)] == [sm64(k) | 1 for k in range(5)]
    expected = [(buffer_factor(3, 4) * slot_factor(p)) & M64 for p in (0, 1, 70000)]
    assert [int(x) for x in dg.page_factors(3, 4, [0, 1, 70000])] == expected
    assert [int(x) for x in dg.slot_factors([0, 5, (1 << 32) - 1])] == [slot_factor(p) for p in (0, 5, (1 << 32) - 1)]
    assert dg.buffer_factor(2, 9) == buffer_factor(2, 9) and dg.slot_factor(12) == slot_factor(12)
    bw = [int(x) for x in dg.byte_weight_vector(10)]
    assert bw == [((sm64(i // 8) | 1) << (8 * (i % 8))) & M64 for i in range(10)]


@pytest.mark.timeout(10)
def test_frame_round_trip_and_merge():
    a = dg.encode_frame({(0, 0): 5, (0, 1): M64, (2, 3): 1}, {0: [4, 2, 2], 2: [9]})
    digests, pages = dg.decode_frame(a)
    assert digests == {(0, 0): 5, (0, 1): M64, (2, 3): 1}
    assert pages == {0: [2, 4], 2: [9]}
    b = dg.decode_frame(dg.encode_frame({(0, 0): 7, (0, 1): 2}, {0: [4, 5]}))
    sums, union, ranks = dg.merge_frames({0: (digests, pages), 1: b})
    assert sums == {(0, 0): 12, (0, 1): 1, (2, 3): 1}  # M64 + 2 wraps to 1
    assert union == {0: [2, 4, 5], 2: [9]}
    assert ranks[(0, 0)] == [0, 1] and ranks[(2, 3)] == [0]
    assert dg.first_mismatch(sums, {(0, 0): 12, (0, 1): 1, (2, 3): 1}) is None
    assert dg.first_mismatch(sums, {(0, 0): 12, (0, 1): 2, (2, 3): 0}) == (0, 1)
    assert dg.component_name(0) == "kv" and dg.component_name(1) == "aux" and dg.component_name(3) == "state1"


@pytest.mark.timeout(10)
def test_merge_counts_a_replicated_write_once():
    # Two prefill ranks (TP 2 -> decode TP 1) both write aux row 3 with the same bytes
    # (same digest, same pages): it landed once, so it counts once. Their KV parts are
    # head slices of the same pages (different digests): summed. A rank whose aux copy
    # differs (other bytes) is summed too, and then cannot match what landed.
    r0 = ({(0, 0): 10, (1, 0): 77}, {0: [6, 7], 1: [3]})
    r1 = ({(0, 0): 20, (1, 0): 77}, {0: [6, 7], 1: [3]})
    sums, union, ranks = dg.merge_frames({0: r0, 1: r1})
    assert sums == {(0, 0): 30, (1, 0): 77}
    assert ranks[(1, 0)] == [0, 1] and union == {0: [6, 7], 1: [3]}
    r1_other = ({(0, 0): 20, (1, 0): 78}, {0: [6, 7], 1: [3]})
    assert dg.merge_frames({0: r0, 1: r1_other})[0][(1, 0)] == 77 + 78
    # Same digest over other pages is another write: summed.
    r1_moved = ({(0, 0): 20, (1, 0): 77}, {0: [6, 7], 1: [4]})
    assert dg.merge_frames({0: r0, 1: r1_moved})[0][(1, 0)] == 2 * 77


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "frame, message",
    [
        (b"XXXXX", "bad magic"),
        (b"SDXV1" + b"\0" * 8, "bad magic"),  # version 1 (32-bit words) is a different digest
        (dg.FRAME_MAGIC + b"\x01\0\0\0", "truncated"),
        (dg.FRAME_MAGIC + b"\0\0\0\0\0\0\0\0!", "trailing"),
        (dg.FRAME_MAGIC + b"\x01\0\0\0" + b"\0\0\0\0" + b"\0" * 8 + b"\0\0\0\0", "no pages"),
    ],
)
def test_malformed_frames_are_refused(frame, message):
    with pytest.raises(dg.DigestError, match=message):
        dg.decode_frame(frame)


@pytest.mark.timeout(10)
def test_indices_out_of_range_are_refused():
    with pytest.raises(dg.DigestError, match="component 70000"):
        dg.page_factor(70000, 0, 0)
    with pytest.raises(dg.DigestError, match="page 4294967296 out of range in component 0 buffer 0"):
        dg.page_factors(0, 0, [1 << 32])
    with pytest.raises(dg.DigestError, match="page -1 out of range"):
        dg.slot_factors([3, -1])
