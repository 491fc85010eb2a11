"""Chunk planning for retract/resume offload (F5). No SGLang or torch import.

When a decode request is retracted, SGLang copies its KV rows to the host in
chunks of ``cpu_offloading_chunk_size`` *tokens* (8192 in every release), so a
long request never needs one huge temporary on the device. The NSA pool's
index-key buffer (``index_k_with_scale_buffer``) is indexed by *page*, not by
token: row ``p`` holds the index keys and scales of tokens
``p * page_size ... p * page_size + page_size - 1``. This module decides:

* which pages a request's token indices occupy (:func:`page_starts`),
* how a list of rows (tokens or pages) is cut into chunks on offload
  (:func:`chunk_bounds`, :func:`page_chunk_rows`),
* where each stored chunk goes back on restore (:func:`restore_bounds`),
  which follows the chunks as they were stored, so a restore never depends on
  the chunk size still being the one used at offload time.

Everything here works on plain sequences, NumPy arrays and torch tensors alike
(only slicing, ``len`` and ``//`` are used on index arrays).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

Bounds = List[Tuple[int, int]]


class ChunkLayoutError(ValueError):
    """A stored offload copy does not fit the rows it is restored to."""


def page_chunk_rows(chunk_tokens: int, page_size: int) -> int:
    """Pages per chunk for a token chunk size: whole pages, at least one.

    A chunk of pages never holds more tokens than ``chunk_tokens`` unless a
    single page is already larger than the chunk (then one page per chunk).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk_tokens}")
    if page_size <= 0:
        raise ValueError(f"page size must be positive, got {page_size}")
    return max(1, chunk_tokens // page_size)


def chunk_bounds(n_rows: int, chunk_rows: int) -> Bounds:
    """``[(start, stop), ...]`` cutting ``n_rows`` rows into chunks of ``chunk_rows``.

    The last chunk may be short; no rows gives no chunks.
    """
    if n_rows < 0:
        raise ValueError(f"row count must be >= 0, got {n_rows}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk_rows}")
    return [(s, min(s + chunk_rows, n_rows)) for s in range(0, n_rows, chunk_rows)]


def page_starts(token_indices, page_size: int):
    """Page index of every page a request's tokens occupy, in request order.

    A request's token slots come from SGLang's paged allocator: its token ``k``
    sits at in-page offset ``k % page_size`` of its ``k // page_size``-th page.
    So every ``page_size``-th token starts a page, and a short last page still
    counts. Returns the same kind of array it was given (a torch tensor stays
    on its device; nothing is synchronised).
    """
    if page_size <= 0:
        raise ValueError(f"page size must be positive, got {page_size}")
    return token_indices[::page_size] // page_size


def n_pages(n_tokens: int, page_size: int) -> int:
    """Pages covered by ``n_tokens`` page-aligned tokens (ceil division)."""
    if n_tokens < 0 or page_size <= 0:
        raise ValueError(f"bad n_tokens={n_tokens} / page_size={page_size}")
    return -(-n_tokens // page_size)


def restore_bounds(chunk_lengths: Sequence[int], n_rows: int) -> Bounds:
    """Where each stored chunk goes back, given the stored chunks' row counts.

    Chunks are laid back in order; their lengths must add up to ``n_rows`` and
    none may be empty (offload never stores an empty chunk).
    """
    bounds: Bounds = []
    start = 0
    for i, length in enumerate(chunk_lengths):
        if length <= 0:
            raise ChunkLayoutError(f"stored chunk {i} has {length} rows")
        bounds.append((start, start + length))
        start += length
    if start != n_rows:
        raise ChunkLayoutError(
            f"stored copy holds {start} rows in {len(bounds)} chunks, "
            f"but {n_rows} rows are being restored"
        )
    return bounds


def peak_chunk_bytes(n_rows: int, chunk_rows: int, row_bytes: int) -> int:
    """Bytes of the largest chunk: the most one chunk's temporary can take."""
    if n_rows <= 0:
        return 0
    return min(n_rows, chunk_rows) * row_bytes
