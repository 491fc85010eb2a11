"""Byte ranges for one state component's send (F3, MoRI). No SGLang import.

MoRI writes (local offset, remote offset, size) triples per registered buffer.
Given a component's plan from :mod:`.state_plan`, these functions say which
bytes of each buffer move:

* :func:`paged_byte_blocks` -- SWA / NSA / DSA / DSv4 pages: contiguous runs of
  (prefill page, decode page) pairs become one range each, page ``p`` of a
  buffer starting at ``p * item_len`` on both sides.
* :func:`mamba_slot_block` -- a Mamba slot: the whole slot when both sides use
  the same attention TP size, else the slice of the leading dimension that this
  prefill rank owns on the decode rank (SGLang 0.5.12.post1's rule,
  ``mori/conn.py:1000-1040``), with the sizes checked instead of assumed.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .state_plan import StateTransferError

Block = Tuple[int, int, int]  # (local byte offset, remote byte offset, size)


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(src start, dst start, count) for each run where both sides step by +1."""
    s = np.asarray(src, dtype=np.int64).ravel()
    d = np.asarray(dst, dtype=np.int64).ravel()
    if s.size != d.size:
        raise StateTransferError(f"page lists differ in length: {s.size} prefill vs {d.size} decode")
    if s.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [s.size]))
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]


def paged_byte_blocks(
    src_pages: Sequence[int], dst_pages: Sequence[int], item_len: int
) -> Tuple[List[int], List[int], List[int]]:
    """(local offsets, remote offsets, sizes) for one buffer of ``item_len``-byte pages."""
    item_len = int(item_len)
    if item_len < 0:
        raise StateTransferError(f"negative page size {item_len}")
    local, remote, sizes = [], [], []
    for s, d, n in contiguous_runs(src_pages, dst_pages):
        local.append(s * item_len)
        remote.append(d * item_len)
        sizes.append(n * item_len)
    return local, remote, sizes


def mamba_slot_block(
    src_slot: int,
    dst_slot: int,
    src_item_len: int,
    dst_item_len: Optional[int] = None,
    *,
    src_dim: Optional[int] = None,
    dst_dim: Optional[int] = None,
    prefill_tp_size: int = 1,
    decode_tp_size: int = 1,
    prefill_tp_rank: int = 0,
    decode_tp_rank: int = 0,
) -> Block:
    """The byte range of one Mamba tensor's slot that this prefill rank writes.

    Same attention TP on both sides: the whole slot (the two sides' slot sizes
    must agree when decode's is known). Different TP: the tensor's leading
    dimension is split across ranks; ``src_dim`` / ``dst_dim`` are each side's
    share of it and both are needed (without them the slot layouts cannot be
    matched; with equal slot sizes the state is taken as replicated and copied
    whole, with different sizes this refuses rather than copy a wrong-sized slot).
    """
    src_slot, dst_slot, src_item_len = int(src_slot), int(dst_slot), int(src_item_len)
    if src_slot < 0 or dst_slot < 0:
        raise StateTransferError(f"negative Mamba slot (prefill {src_slot}, decode {dst_slot})")
    if prefill_tp_size == decode_tp_size:
        if dst_item_len is not None and int(dst_item_len) != src_item_len:
            raise StateTransferError(
                f"Mamba slot size differs with equal TP: prefill {src_item_len} bytes, decode {int(dst_item_len)} bytes"
            )
        return src_slot * src_item_len, dst_slot * src_item_len, src_item_len

    if (not src_dim or not dst_dim) and dst_item_len is not None and int(dst_item_len) == src_item_len:
        # No dimension info and equal slot sizes: the state is replicated, not
        # split (SGLang's fallback to a whole-slot copy in this case).
        return src_slot * src_item_len, dst_slot * src_item_len, src_item_len
    if not src_dim or not dst_dim or dst_item_len is None:
        raise StateTransferError(
            f"Mamba state with prefill TP {prefill_tp_size} and decode TP {decode_tp_size} needs each side's "
            f"per-tensor dimension (got prefill {src_dim}, decode {dst_dim})"
        )
    src_dim, dst_dim, dst_item_len = int(src_dim), int(dst_dim), int(dst_item_len)
    if src_item_len % src_dim or dst_item_len % dst_dim:
        raise StateTransferError(
            f"Mamba slot sizes ({src_item_len}, {dst_item_len}) are not multiples of their dimensions "
            f"({src_dim}, {dst_dim})"
        )
    src_bytes_per_dim = src_item_len // src_dim
    dst_bytes_per_dim = dst_item_len // dst_dim
    if src_bytes_per_dim != dst_bytes_per_dim:
        raise StateTransferError(
            f"Mamba rows differ in size: prefill {src_bytes_per_dim} bytes, decode {dst_bytes_per_dim} bytes"
        )
    if prefill_tp_size > decode_tp_size:
        if prefill_tp_size % decode_tp_size:
            raise StateTransferError(f"prefill TP {prefill_tp_size} is not a multiple of decode TP {decode_tp_size}")
        writers = prefill_tp_size // decode_tp_size
        src_start, count = 0, src_dim
        dst_start = (prefill_tp_rank % writers) * src_dim
    else:
        src_start = (decode_tp_rank * dst_dim) % src_dim
        count = dst_dim
        dst_start = 0
    if src_start + count > src_dim or dst_start + count > dst_dim:
        raise StateTransferError(
            f"Mamba slice [{src_start}, {src_start + count}) of {src_dim} -> [{dst_start}, {dst_start + count}) "
            f"of {dst_dim} is out of range"
        )
    return (
        src_slot * src_item_len + src_start * src_bytes_per_dim,
        dst_slot * dst_item_len + dst_start * dst_bytes_per_dim,
        count * src_bytes_per_dim,
    )
