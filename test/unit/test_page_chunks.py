"""Chunk planning for F5 offload/restore (pure logic, hand-derived tables)."""

import numpy as np
import pytest

from sglang_disagg_ext.core.page_chunks import (
    ChunkLayoutError,
    chunk_bounds,
    n_pages,
    page_chunk_rows,
    page_starts,
    peak_chunk_bytes,
    restore_bounds,
)

# (chunk_tokens, page_size) -> pages per chunk.
PAGE_CHUNK_ROWS = [
    (8192, 64, 128),  # SGLang's default chunk, NSA page size
    (8192, 1, 8192),  # HIP NSA (page_size 1): pages == tokens
    (100, 64, 1),  # 100 // 64 = 1
    (128, 64, 2),
    (127, 64, 1),
    (63, 64, 1),  # a page larger than the chunk: still one page per chunk
    (1, 64, 1),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("chunk_tokens,page_size,expected", PAGE_CHUNK_ROWS)
def test_page_chunk_rows(chunk_tokens, page_size, expected):
    assert page_chunk_rows(chunk_tokens, page_size) == expected


# (n_rows, chunk_rows) -> bounds, worked out by hand.
CHUNK_BOUNDS = [
    (0, 4, []),
    (1, 4, [(0, 1)]),
    (4, 4, [(0, 4)]),
    (5, 4, [(0, 4), (4, 5)]),
    (9, 4, [(0, 4), (4, 8), (8, 9)]),
    (3, 1, [(0, 1), (1, 2), (2, 3)]),
    (7, 100, [(0, 7)]),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n_rows,chunk_rows,expected", CHUNK_BOUNDS)
def test_chunk_bounds(n_rows, chunk_rows, expected):
    assert chunk_bounds(n_rows, chunk_rows) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [(-1, 4), (4, 0), (4, -2)])
def test_chunk_bounds_rejects(bad):
    with pytest.raises(ValueError):
        chunk_bounds(*bad)


# Token slots of one request from a paged allocator, page_size 4 for
# readability: pages [3, 1, 7] hold tokens 12-15, 4-7, 28-31.
def _tokens(pages, page_size, n_tokens):
    return np.concatenate([np.arange(p * page_size, (p + 1) * page_size) for p in pages])[:n_tokens]


PAGE_STARTS = [
    # (pages, page_size, n_tokens) -> expected page list
    ([3, 1, 7], 4, 12, [3, 1, 7]),  # full pages
    ([3, 1, 7], 4, 9, [3, 1, 7]),  # last page holds one token
    ([3, 1, 7], 4, 8, [3, 1]),  # last page unused
    ([3, 1, 7], 4, 1, [3]),
    ([3, 1, 7], 4, 0, []),
    ([5, 6, 2], 1, 3, [5, 6, 2]),  # page_size 1: pages are tokens
    ([2, 9], 64, 100, [2, 9]),  # NSA page size, partial last page
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pages,page_size,n_tokens,expected", PAGE_STARTS)
def test_page_starts(pages, page_size, n_tokens, expected):
    tokens = _tokens(pages, page_size, n_tokens)
    assert page_starts(tokens, page_size).tolist() == expected
    assert len(expected) == n_pages(n_tokens, page_size)


@pytest.mark.timeout(10)
def test_page_starts_works_on_torch_tensors():
    torch = pytest.importorskip("torch")
    tokens = torch.tensor(_tokens([3, 1, 7], 4, 10))
    out = page_starts(tokens, 4)
    assert isinstance(out, torch.Tensor) and out.tolist() == [3, 1, 7]


# Stored chunk lengths -> restore bounds.
RESTORE_BOUNDS = [
    ([], 0, []),
    ([4], 4, [(0, 4)]),
    ([4, 4, 1], 9, [(0, 4), (4, 8), (8, 9)]),
    # Stored with a chunk of 2 and restored after the pool's chunk size changed:
    # the stored layout decides, not the current chunk size.
    ([2, 2, 1], 5, [(0, 2), (2, 4), (4, 5)]),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lengths,n_rows,expected", RESTORE_BOUNDS)
def test_restore_bounds(lengths, n_rows, expected):
    assert restore_bounds(lengths, n_rows) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lengths,n_rows", [([4, 4], 9), ([4, 4, 1], 8), ([4, 0], 4), ([], 1)])
def test_restore_bounds_rejects_mismatch(lengths, n_rows):
    with pytest.raises(ChunkLayoutError):
        restore_bounds(lengths, n_rows)


@pytest.mark.timeout(10)
def test_offload_then_restore_bounds_round_trip():
    for n in range(0, 40):
        for c in range(1, 12):
            stored = chunk_bounds(n, c)
            assert restore_bounds([b - a for a, b in stored], n) == stored


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "n_rows,chunk_rows,row_bytes,expected",
    [(0, 128, 8448, 0), (5, 128, 8448, 5 * 8448), (300, 128, 8448, 128 * 8448)],
)
def test_peak_chunk_bytes(n_rows, chunk_rows, row_bytes, expected):
    assert peak_chunk_bytes(n_rows, chunk_rows, row_bytes) == expected
