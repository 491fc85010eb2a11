"""Metadata (aux) rows sent over MoRI's TCP path: length facts and the check (F12).

SGLang's MoRI backend sends each metadata buffer's row of a request as one
``AUX_DATA`` message (buffer index, destination row, declared length, bytes),
and the decode writes ``len(bytes)`` at ``row * item_len`` of that buffer.
Stock 0.5.23 (``mori/conn.py:1971-1984``) drops a message whose bytes disagree
with the declared length (a log line; the room still reports Success with a
stale row) and never compares the length with the row size: a longer row
would run into the next row, a shorter one leaves the tail stale.

This module holds the pure parts: the registration frame that carries the
decode's row sizes to the prefill (so the prefill can check each row before it
sends and fail the room on both sides), and the one check both sides apply.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Sequence

# Registration frame appended by the decode after SGLang's own frames: magic,
# version, count (uint32 LE), then that many uint32 LE row sizes. A stock
# prefill reads SGLang's frames by position and ignores anything after them.
AUX_LENS_MAGIC = b"SDXA"
AUX_LENS_VERSION = 1
MAX_AUX_BUFFERS = 4096


class AuxRowError(ValueError):
    """A malformed row-size frame."""


def encode_aux_item_lens(lens: Sequence[int]) -> bytes:
    values = [int(n) for n in lens]
    if len(values) > MAX_AUX_BUFFERS or any(not 0 <= n < 2**32 for n in values):
        raise AuxRowError(f"aux row sizes out of range: {len(values)} buffers, sizes {values[:8]}")
    return AUX_LENS_MAGIC + bytes([AUX_LENS_VERSION]) + struct.pack(f"<I{len(values)}I", len(values), *values)


def decode_aux_item_lens(frame: bytes) -> Optional[List[int]]:
    """The decode's row sizes, or ``None`` when ``frame`` is not this frame (stock
    decode: no such frame). Raises :class:`AuxRowError` on a malformed one."""
    head = len(AUX_LENS_MAGIC) + 1
    if not frame.startswith(AUX_LENS_MAGIC):
        return None
    if len(frame) < head + 4:
        raise AuxRowError(f"aux row-size frame of {len(frame)} bytes is shorter than its {head + 4}-byte header")
    if frame[len(AUX_LENS_MAGIC)] != AUX_LENS_VERSION:
        raise AuxRowError(
            f"aux row-size frame version {frame[len(AUX_LENS_MAGIC)]}, this plugin speaks {AUX_LENS_VERSION}: "
            "run the same sglang_disagg_ext on both sides"
        )
    (count,) = struct.unpack_from("<I", frame, head)
    if count > MAX_AUX_BUFFERS or len(frame) != head + 4 + 4 * count:
        raise AuxRowError(f"aux row-size frame says {count} buffers but holds {len(frame) - head - 4} bytes of sizes")
    return list(struct.unpack_from(f"<{count}I", frame, head + 4))


def aux_row_problem(
    buffer_index: int,
    row: int,
    data_len: int,
    row_len: Optional[int],
    *,
    declared_len: Optional[int] = None,
    num_rows: Optional[int] = None,
    sender_len: Optional[int] = None,
) -> Optional[str]:
    """Why one metadata row must not be written, or ``None``.

    ``buffer_index``/``row``: the metadata buffer and destination row;
    ``data_len``: bytes carried; ``row_len``: the destination's row size for
    that buffer (``None``: the destination has no such buffer);
    ``declared_len``: the length the message declares (decode side);
    ``num_rows``: rows the destination buffer holds; ``sender_len``: the
    sending side's row size, named in the reason when known.
    """
    where = f"metadata (aux) buffer {buffer_index}, row {row}"
    if row_len is None:
        return f"{where}: the receiving side has no such buffer"
    if declared_len is not None and declared_len != data_len:
        return f"{where}: the message declares {declared_len} bytes but carries {data_len}"
    if data_len != row_len:
        sent = f"prefill row {sender_len} bytes, " if sender_len is not None and sender_len != data_len else ""
        return f"{where}: {sent}{data_len} bytes sent, decode row is {row_len} bytes"
    if row < 0:
        return f"{where}: negative row"
    if num_rows is not None and row >= num_rows:
        return f"{where}: row outside the decode buffer's {num_rows} rows"
    return None


def aux_row_blocks(src_ptrs: Sequence[int], item_lens: Sequence[int], dst_ptrs: Sequence[int],
                   src_row: int, dst_row: int) -> List[tuple]:
    """``(src, dst, length)`` of the rows a request's metadata moves, one per buffer both sides
    have: row ``src_row`` of each prefill buffer to row ``dst_row`` of the decode buffer of the
    same index, ``item_lens[i]`` bytes (prefill's row size, which both SGLang paths send). The
    blocks an RDMA write of the rows has; over TCP (``send_aux_tcp``) the same bytes go in
    messages, and verified transfers digest them as these blocks."""
    n = min(len(src_ptrs), len(item_lens), len(dst_ptrs))
    return [(int(src_ptrs[i]) + int(item_lens[i]) * src_row, int(dst_ptrs[i]) + int(item_lens[i]) * dst_row,
             int(item_lens[i])) for i in range(n)]
