"""backends.common.digest_kernels agree with core.digest's byte-by-byte reference.

The reference (``core.digest.item_digest``) is checked by hand in test_digest.py;
here the pool-side kernels (64-bit words through numpy ``einsum`` on CPU, torch
int64 on CUDA; per-byte weights for spans) must give the same value for whole
items, items that are not a multiple of 8 bytes, gathered rows, unaligned rows,
and slices that start or end inside a word; and spans must compose into the
whole-item digest.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sglang_disagg_ext.backends.common import digest_kernels  # noqa: E402
from sglang_disagg_ext.backends.common.digest_kernels import (  # noqa: E402
    _device_totals,
    run_index,
    _slot_factors,
    rows_digest,
    rows_digests,
    span_digest,
    span_digests,
)
from sglang_disagg_ext.core import digest as dg  # noqa: E402

M64 = (1 << 64) - 1
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _sm64(z):
    """splitmix64 (Steele, Lea, Flood 2014), independent of core.digest."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _rows(n, item_len, seed):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, size=(n, item_len), dtype=np.uint8))


def _reference(rows, c, b, pages):
    return dg.combine(dg.item_digest(bytes(rows[i].cpu().numpy()), c, b, p) for i, p in enumerate(pages))


@pytest.mark.timeout(10)
def test_rows_digest_by_hand():
    # One 16-byte item: words 0x..00FF01 = 0xFF01 and 2**63 at KV buffer 0, page 3.
    item = torch.tensor([[0x01, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80]], dtype=torch.uint8)
    m = (_sm64((0 << 48) ^ (0 << 32) ^ 0x5EEDD16E57A10000) | 1) * (_sm64(3 ^ 0x5107FAC700000000) | 1)
    expected = ((0xFF01 * (_sm64(0) | 1) + (1 << 63) * (_sm64(1) | 1)) * m) & M64
    assert rows_digest(item, 0, 0, [3]) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("item_len", [8, 64, 4, 6, 13, 20])
def test_rows_digest_matches_reference(item_len, device):
    rows = _rows(5, item_len, item_len)
    rows[0, :4] = 0xFF  # high bytes set: unsigned words, and products that wrap
    pages = [9, 0, 3, 70000, 12]
    assert rows_digest(rows.to(device), 2, 1, pages) == _reference(rows, 2, 1, pages)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device", DEVICES)
def test_rows_digest_gathers_pool_rows(device):
    # Decode's path (and prefill's fragmented blocks): rows picked out of a pool by index.
    pool = _rows(12, 32, 1)
    index, pages = [7, 2, 11, 2], [0, 5, 6, 1]
    expected = _reference(pool[index], 0, 3, pages)
    assert rows_digest(pool.to(device), 0, 3, pages, index=index) == expected
    assert rows_digest(pool.to(device), 0, 3, pages, index=torch.tensor(index)) == expected
    assert rows_digest(pool.to(device), 0, 3, [], index=[]) == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device", DEVICES)
def test_rows_digests_in_one_call_match_the_reference(device):
    # Several buffers in one call (one copy back on a device), in request order, with
    # an empty request, an unaligned item width and a high buffer factor among them.
    pool = _rows(12, 32, 2)
    odd = _rows(3, 13, 3)
    requests = [
        (pool.to(device), 0, 3, [4, 0, 9], [5, 5, 1]),
        (odd.to(device), 2, 0, [1, 2, 3], None),
        (pool.to(device), 1, 7, [], []),
        (pool[:2].to(device), 0, 60, [70000, 8], None),
    ]
    expected = [
        _reference(pool[[5, 5, 1]], 0, 3, [4, 0, 9]),
        _reference(odd, 2, 0, [1, 2, 3]),
        0,
        _reference(pool[:2], 0, 60, [70000, 8]),
    ]
    assert rows_digests(requests) == expected
    assert rows_digests([]) == []


@pytest.mark.timeout(30)
def test_single_items_digested_together_match_the_reference():
    # One item per request (a metadata row per buffer, as verified transfers send them): rows of
    # 8, 24, 16 and 4096 bytes from different pools, by index and as one-row slices, NumPy and
    # torch, among requests of several items; each digest as the byte reference gives it, in order.
    pools = [_rows(6, 8, 11), _rows(5, 24, 12), _rows(4, 16, 13), _rows(3, 4096, 14)]
    many = _rows(9, 32, 15)
    requests = [
        (pools[0], 1, 0, [2], [5]),
        (pools[1].numpy(), 1, 1, np.array([0]), np.array([4])),
        (many, 0, 2, [7, 1], [8, 0]),
        (pools[2][3:4], 1, 2, [9], None),
        (pools[3].numpy(), 3, 0, [70001], [1]),
        (pools[0].numpy()[2:3], 1, 9, [0], None),
    ]
    expected = [
        _reference(pools[0][[5]], 1, 0, [2]),
        _reference(pools[1][[4]], 1, 1, [0]),
        _reference(many[[8, 0]], 0, 2, [7, 1]),
        _reference(pools[2][3:4], 1, 2, [9]),
        _reference(pools[3][[1]], 3, 0, [70001]),
        _reference(pools[0][2:3], 1, 9, [0]),
    ]
    assert rows_digests(requests) == expected
    for bad in ([6], [-1]):  # a row outside the pool is an error, never a wrapped or clipped row
        with pytest.raises(IndexError, match="outside 6 rows"):
            rows_digests([(pools[0], 1, 0, [2], bad), (pools[1], 1, 1, [0], [1])])


_SUPPORT = pathlib.Path(__file__).resolve().parents[1] / "support"


def _kernel_expected():
    sys.path.insert(0, str(_SUPPORT))
    try:
        import digest_kernel_cases as kc
    finally:
        sys.path.remove(str(_SUPPORT))
    expected = []
    for r, c, b, pages, index in kc.cases():
        picked = r if index is None else r[[int(x) for x in index]]
        expected.append(_reference(picked, c, b, pages))
    return kc, expected


@pytest.mark.timeout(180)
def test_fused_kernel_matches_the_reference_in_tritons_interpreter():
    # The Triton kernel a GPU runs, here through Triton's CPU interpreter in a child process
    # (test/support/digest_kernel_cases.py says why a child): one launch over requests of
    # different widths, a host index, no index, a device-side index and an item longer than one
    # step. On a GPU the CUDA cases of this file run it compiled (rows_digests on CUDA).
    pytest.importorskip("triton")
    _, expected = _kernel_expected()
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(_SUPPORT / "digest_kernel_cases.py")], env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device", DEVICES)
def test_device_path_matches_the_reference(device):
    kc, expected = _kernel_expected()
    assert _device_totals(torch.device(device), kc.items(device)) == expected


@pytest.mark.timeout(30)
def test_rows_digest_index_in_runs_digests_in_place(monkeypatch):
    # Two long runs of pool rows (at least 64 KiB a run on average): digested in place
    # without a gather (the gather buffer is never asked for); same value as the
    # reference, and an index past the pool's end is an error on both paths, never a
    # silently shorter slice. Short runs (8 KiB a run here, 80 KiB in all) take the gather;
    # a few rows (at most 64 KiB in all) one indexed copy, with neither.
    gathers = []
    scratch = digest_kernels._scratch
    monkeypatch.setattr(digest_kernels, "_scratch", lambda n: gathers.append(n) or scratch(n))
    pool = _rows(80, 4096, 4)
    index = list(range(2, 30)) + list(range(40, 70))
    pages = list(range(100, 100 + len(index)))
    assert rows_digest(pool, 2, 0, pages, index=index) == _reference(pool[index], 2, 0, pages)
    assert gathers == []
    few = [2, 3, 9, 10, 20]  # 20 KiB in all: one indexed copy, no gather buffer
    assert rows_digest(pool, 2, 0, [1, 2, 3, 4, 5], index=few) == _reference(pool[few], 2, 0, [1, 2, 3, 4, 5])
    assert gathers == []
    short = [r for start in range(0, 80, 8) for r in (start, start + 1)]  # ten runs of 8 KiB: gathered
    pages = list(range(len(short)))
    assert rows_digest(pool, 2, 0, pages, index=short) == _reference(pool[short], 2, 0, pages)
    assert len(gathers) == 1
    with pytest.raises((IndexError, RuntimeError)):
        rows_digest(pool, 2, 0, list(range(40)), index=list(range(50, 90)))  # in-place path
    with pytest.raises((IndexError, RuntimeError)):
        rows_digest(pool, 2, 0, pages, index=short[:-1] + [80])  # gather path
    with pytest.raises((IndexError, RuntimeError)):
        rows_digest(pool, 2, 0, pages, index=[-1] + short[1:])  # gather path, below the pool
    with pytest.raises((IndexError, RuntimeError)):
        rows_digest(pool, 2, 0, [0, 1], index=[3, 80])  # indexed copy
    with pytest.raises((IndexError, RuntimeError)):
        rows_digest(pool, 2, 0, [0, 1], index=[-1, 3])  # indexed copy, below the pool


@pytest.mark.timeout(30)
def test_slot_factor_table_matches_definition():
    # The kernel's shared table (and its direct path past the table's cap) give
    # slot_factor(p) = splitmix64(p ^ SLOT_SALT) | 1, derived here independently.
    pages = [0, 5, 4095, 70000, (1 << 20) + 3, (1 << 32) - 1]
    assert [int(x) for x in _slot_factors(pages)] == [_sm64(p ^ 0x5107FAC700000000) | 1 for p in pages]
    assert _slot_factors([]).size == 0
    for bad in ([-1], [1 << 32]):
        with pytest.raises(dg.DigestError, match="out of range"):
            _slot_factors(bad)
    with pytest.raises(dg.DigestError, match="out of range"):
        rows_digest(_rows(1, 8, 0), 0, 0, [-1])


@pytest.mark.timeout(30)
def test_rows_digest_unaligned_and_strided_rows():
    # Rows that start 1 byte into a buffer, and rows that are a column slice of wider rows.
    flat = _rows(1, 1 + 4 * 24, 2).reshape(-1)
    unaligned = flat[1:].view(4, 24)
    assert rows_digest(unaligned, 1, 0, [3, 2, 1, 0]) == _reference(unaligned, 1, 0, [3, 2, 1, 0])
    strided = _rows(3, 40, 3)[:, 8:32]
    assert not strided.is_contiguous()
    assert rows_digest(strided, 2, 2, [4, 5, 6]) == _reference(strided, 2, 2, [4, 5, 6])
    # The same as NumPy host rows (how the verified managers hand their CPU buffers over):
    # unaligned words read as they are, column slices and 20-byte items through the padded path,
    # a pool with a row index the same as its gathered rows.
    assert rows_digest(unaligned.numpy(), 1, 0, [3, 2, 1, 0]) == _reference(unaligned, 1, 0, [3, 2, 1, 0])
    assert rows_digest(strided.numpy(), 2, 2, [4, 5, 6]) == _reference(strided, 2, 2, [4, 5, 6])
    odd = _rows(3, 20, 5)
    assert rows_digest(odd.numpy(), 0, 1, [7, 8, 9]) == _reference(odd, 0, 1, [7, 8, 9])
    pool = _rows(40, 64, 6)
    index = [5, 6, 7, 30, 2]
    assert rows_digest(pool.numpy(), 0, 2, [1, 2, 3, 4, 5], index=index) == _reference(pool[index], 0, 2,
                                                                                       [1, 2, 3, 4, 5])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("offset, length", [(0, 32), (5, 20), (30, 7), (0, 1), (13, 40)])
def test_span_digest_matches_reference(offset, length):
    item_len = 16
    data = _rows(1, length, offset + length).reshape(-1)
    value, pages = span_digest(data, offset, item_len, 0, 4)
    expected = 0
    for i in range(length):  # byte i lands at destination byte offset + i
        pos = offset + i
        expected += dg.item_digest(bytes([int(data[i])]), 0, 4, pos // item_len, offset=pos % item_len)
    assert value == expected & dg.MASK
    assert pages == list(range(offset // item_len, (offset + length - 1) // item_len + 1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("item_len", [24, 12, 13])
def test_spans_compose_into_whole_items(item_len):
    # Items at destination pages 2..4; slices cut on and inside words (and items
    # not a multiple of 8 bytes): the spans' digests sum to the whole items'.
    rows = _rows(3, item_len, 40 + item_len)
    whole = rows_digest(rows, 0, 1, [2, 3, 4])
    flat, base_off = rows.reshape(-1), 2 * item_len
    for cuts in ([item_len], [5], [1, 9, item_len + 3], [item_len - 1, 2 * item_len + 7]):
        bounds = [0] + cuts + [flat.numel()]
        total = 0
        for lo, hi in zip(bounds, bounds[1:]):
            value, _ = span_digest(flat[lo:hi], base_off + lo, item_len, 0, 1)
            total += value
        assert total & dg.MASK == whole, cuts


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device", DEVICES + ["cpu-torch"])
@pytest.mark.parametrize("length, item_len, aligned", [(16, 64, True), (8, 24, True), (6, 40, False), (16, 64, False)])
def test_span_digests_equal_the_sum_of_single_spans(device, length, item_len, aligned, monkeypatch):
    # Head slices as a heterogeneous-TP transfer makes them: many spans of one length, each
    # inside one destination item, from scattered source offsets to scattered destination
    # pages and token slots. The batched call equals the sum of one span_digest per span
    # (itself checked byte by byte above), on the word path (aligned) and the byte path;
    # "cpu-torch": the torch path a GPU takes, run on CPU.
    if device == "cpu-torch":
        monkeypatch.setattr(digest_kernels, "_numpy_path", lambda dev: False)
        device = "cpu"
    gen = torch.Generator().manual_seed(length * 131 + item_len)
    flat = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    rng = np.random.default_rng(length + item_len)
    n = 200
    unit = 8 if aligned else 1
    slots = (item_len - length) // unit + 1
    src = rng.integers(0, (4096 - length) // unit, n) * unit + (0 if aligned else 1) * (rng.integers(0, 2, n))
    dst = rng.integers(0, 50, n) * item_len + rng.integers(0, slots, n) * unit
    value, pages = span_digests(flat.to(device), src, dst, length, item_len, 2, 3)
    expected = 0
    for s_off, d_off in zip(src.tolist(), dst.tolist()):
        expected += span_digest(flat[s_off:s_off + length], d_off, item_len, 2, 3)[0]
    assert value == expected & dg.MASK
    assert pages.tolist() == sorted(set((dst // item_len).tolist()))
    with pytest.raises(ValueError):  # a span across an item boundary is the caller's to split
        span_digests(flat, [0], [item_len - 1], length, item_len, 2, 3)


@pytest.mark.timeout(10)
def test_run_index_expands_runs():
    assert run_index([5, 0, 9], [2, 1, 3]).tolist() == [5, 6, 0, 9, 10, 11]
    assert run_index([4], [1]).tolist() == [4]
