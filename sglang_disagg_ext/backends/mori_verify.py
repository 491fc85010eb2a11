"""Verified transfers for ``mori-ext`` (issue 16): where MoRI's writes meet the digest.

SGLang's MoRI manager moves every byte RDMA carries with ``engine.batch_write(local
descriptors, local offsets, remote descriptors, remote offsets, sizes, uids)``: each
entry writes ``sizes[i][j]`` bytes from ``local[i].data + local_offsets[i][j]`` to
``remote[i].data + remote_offsets[i][j]`` of engine ``remote[i].engine_key`` (a MoRI
``MemoryDesc`` carries its region's address and its engine's key). So the manager's
``engine`` is wrapped (:class:`RecordingEngine`, through a property set when SGLang's
constructor assigns it) and each batch's blocks go to
:meth:`.VerifiedTransferMixin._verify_add_blocks` per decode engine, before the batch
is handed to MoRI. Decode's buffer starts come from the descriptors in its registration.
Everything else (placement, partials, the status frame, decode's check) is
:mod:`.transfer_verify`'s.

Only where MoRI concludes rooms through SGLang's common status codec (0.5.20+, probe
``mori_status_codec``). Not covered: the metadata row over TCP (``send_aux_tcp``, the
default without RDMA for aux): its page is not listed, so decode does not check it.
MoRI's decode never reads mismatch notices (no ``_handle_abort_notification``), so
prefill is not told. Tested against the MoRI stand-in (``test/support/mori_standin``):
MoRI's engine cannot run on a machine without its RDMA stack.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from sglang_disagg_ext.backends.transfer_verify import (
    RoomQueue,
    VerifiedTransferMixin,
    logger,
    recorded_attribute,
    state_lists,
)


class RecordingEngine:
    """A MoRI ``IOEngine`` whose ``batch_write`` batches are reported to
    ``on_write(engine_key, blocks)`` (``N x 3`` int64 ``(src, dst, length)``) before MoRI gets
    them. Every other attribute is the engine's own; results are the engine's."""

    _verify_wrapped = True

    def __init__(self, engine, on_write):
        self._engine = engine
        self._on_write = on_write

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def batch_write(self, local_descs, local_offsets, remote_descs, remote_offsets, sizes, *args, **kwargs):
        by_peer: Dict[str, List[np.ndarray]] = {}
        for src, s_off, dst, d_off, n in zip(local_descs, local_offsets, remote_descs, remote_offsets, sizes):
            s_off, d_off, n = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (s_off, d_off, n))
            by_peer.setdefault(str(dst.engine_key), []).append(
                np.column_stack((int(src.data) + s_off, int(dst.data) + d_off, n)))
        for peer, parts in by_peer.items():
            self._on_write(peer, np.concatenate(parts))
        return self._engine.batch_write(local_descs, local_offsets, remote_descs, remote_offsets, sizes,
                                        *args, **kwargs)


class MoriVerifiedTransferMixin(VerifiedTransferMixin):
    """MoRI's entry: the blocks of each ``batch_write`` (see the module)."""

    engine = recorded_attribute(
        "_verify_mori_engine", lambda self, engine: RecordingEngine(engine, self._verify_mori_write),
        """The manager's MoRI ``IOEngine``; with verification on, wrapped in :class:`RecordingEngine`.

        Contract: SGLang's constructor assigns ``self.engine`` (both sides; teardown sets it
        to None) and its threads use it afterwards; the wrapper changes no argument or result.""")

    def _transfer_worker(self, queue, *args, **kwargs):
        """Stock ``_transfer_worker`` on a view of its queue that notes each chunk's room.

        Contract: prefill only; SGLang's constructor starts one thread per transfer queue
        with this as target; every item has ``.room`` (teardown's None sentinel passes
        through). Must not change what the loop gets or does.
        """
        if not self._verify_on:
            return super()._transfer_worker(queue, *args, **kwargs)
        return super()._transfer_worker(RoomQueue(queue, self), *args, **kwargs)

    def _verify_dst_pointers(self, info) -> Tuple[List[int], List[int], List[List[int]]]:
        """MoRI registers decode's buffers as memory descriptors: their addresses."""
        def addrs(descs):
            return [int(d.data) for d in descs or []]

        states = state_lists(getattr(info, "dst_state_mem_descs", None))
        return addrs(info.dst_kv_mem_descs), addrs(info.dst_aux_mem_descs), [addrs(s) for s in states]

    def _verify_mori_write(self, peer: str, blocks: Optional[np.ndarray]) -> None:
        """One batch about to go to MoRI (transfer worker thread, prefill). Must never
        raise: a digest that cannot be taken leaves the room unverified."""
        if self.disaggregation_mode.name != "PREFILL" or blocks is None or not blocks.shape[0]:
            return
        try:
            self._verify_add_blocks(peer, blocks)
        except Exception:  # noqa: BLE001 - verification must never fail a transfer by itself
            logger.exception("verified transfers: digest of a MoRI transfer failed; the room goes unverified")
            self._verify_mark_unplaced(peer, "digest raised")
