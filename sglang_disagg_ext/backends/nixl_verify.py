"""Verified transfers for ``nixl-ext`` (issue 16): where NIXL's writes meet the digest.

SGLang's NIXL manager has no single write call like Mooncake's ``_transfer_data``:
it builds descriptor lists (``get_xfer_descs``, ``prep_xfer_dlist``, plain or
strided ``(addr, len, dev, stride, count)`` rows) and creates each transfer from
them (``make_prepped_xfer`` by index, ``initialize_xfer`` from two lists) for KV
pages, heterogeneous-TP head slices, state components and the aux row alike. So the
manager's ``agent`` is wrapped (:class:`RecordingAgent`, set through a property the
moment SGLang's constructor assigns it, so every later use goes through it): it
remembers what each descriptor list and prepared handle holds, and when a WRITE
transfer is created it hands the transfer's ``(src, dst, length)`` blocks and peer
agent to :meth:`.VerifiedTransferMixin._verify_add_blocks`, before the transfer
exists and so before the engine reads a byte. Everything else (placement, partials,
the status frame, decode's check) is :mod:`.transfer_verify`'s.

Only where a NIXL decode learns Success from prefill's ``KV_STATUS`` message alone
(0.5.23, probe ``nixl_success_via_listener_only``): up to 0.5.22 the decode also
concludes Success from NIXL notifications, where no digest travels.

Not covered (the room's pages are simply not listed, or the room goes unverified):
descriptor lists built from tensors (SGLang builds them from addresses), staging
(the destination is decode's staging buffer, not a registered pool: unverified).
Head slices are digested byte by byte (``digest_kernels.span_digest``), slower than
whole pages.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np

from sglang_disagg_ext.backends.transfer_verify import VerifiedTransferMixin, logger, recorded_attribute

_DLIST_MEMORY = 256  # descriptor lists remembered between get_xfer_descs and their use


def descriptor_blocks(descs) -> Optional[np.ndarray]:
    """``(addr, len)`` rows (int64, one per block) of a descriptor list as SGLang hands it
    to NIXL: an ``N x 3`` ``(addr, len, dev)`` array or list of 3-tuples, or an ``N x 5``
    strided array ``(addr, len, dev, stride, count)`` (expanded in row order, as SGLang's
    own fallback ``_expand_stride_descs`` does). None for anything else (tensors)."""
    if isinstance(descs, (list, tuple)):
        if not descs:
            return np.empty((0, 2), dtype=np.int64)
        if not all(isinstance(d, (list, tuple)) and len(d) == 3 for d in descs):
            return None
        descs = np.array(descs, dtype=np.uint64)
    if not isinstance(descs, np.ndarray) or descs.ndim != 2 or descs.shape[1] not in (3, 5):
        return None
    rows = descs.astype(np.uint64, copy=False)
    if rows.shape[1] == 3:
        return rows[:, :2].astype(np.int64)
    counts = rows[:, 4].astype(np.int64)
    n = int(counts.sum())
    row = np.repeat(np.arange(rows.shape[0]), counts)
    k = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)  # block within its row
    out = np.empty((n, 2), dtype=np.int64)
    out[:, 0] = rows[row, 0].astype(np.int64) + k * rows[row, 3].astype(np.int64)
    out[:, 1] = rows[row, 1].astype(np.int64)
    return out


WriteSink = Callable[[str, Optional[np.ndarray], Optional[str]], None]


class RecordingAgent:
    """A ``nixl_agent`` whose WRITE transfers are reported to ``on_write(peer, blocks, why)``
    before they are created (``blocks``: ``N x 3`` int64 ``(src, dst, length)``; ``why`` when
    they cannot be known). Every other attribute is the agent's own; results are the agent's."""

    _verify_wrapped = True

    def __init__(self, agent, on_write: WriteSink):
        self._agent = agent
        self._on_write = on_write
        self._lock = threading.Lock()
        self._dlists: "OrderedDict[int, tuple]" = OrderedDict()  # id -> (dlist, blocks)
        self._prepped = {}  # id(handle) -> (handle, peer, blocks)

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def get_xfer_descs(self, descs, *args, **kwargs):
        dlist = self._agent.get_xfer_descs(descs, *args, **kwargs)
        with self._lock:
            self._dlists[id(dlist)] = (dlist, descriptor_blocks(descs))
            while len(self._dlists) > _DLIST_MEMORY:
                self._dlists.popitem(last=False)
        return dlist

    def _blocks_of(self, descs) -> Optional[np.ndarray]:
        with self._lock:
            hit = self._dlists.get(id(descs))
        if hit is not None and hit[0] is descs:
            return hit[1]
        return descriptor_blocks(descs)

    def prep_xfer_dlist(self, agent_name, xfer_list, *args, **kwargs):
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs)
        blocks = self._blocks_of(xfer_list)
        with self._lock:
            self._prepped[id(handle)] = (handle, agent_name, blocks)
        return handle

    def release_dlist_handle(self, handle, *args, **kwargs):
        with self._lock:
            self._prepped.pop(id(handle), None)
        return self._agent.release_dlist_handle(handle, *args, **kwargs)

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          *args, **kwargs):
        if operation == "WRITE":
            with self._lock:
                local = self._prepped.get(id(local_xfer_side))
                remote = self._prepped.get(id(remote_xfer_side))
            if remote is None or remote[0] is not remote_xfer_side:
                self._on_write("", None, "a prepared remote list the verifier did not see")
            elif local is None or local[0] is not local_xfer_side:
                self._on_write(remote[1], None, "a prepared local list the verifier did not see")
            else:
                self._report(remote[1], local[2], remote[2], local_indices, remote_indices)
        return self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices, remote_xfer_side,
                                             remote_indices, *args, **kwargs)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, *args, **kwargs):
        if operation == "WRITE":
            self._report(remote_agent, self._blocks_of(local_descs), self._blocks_of(remote_descs), None, None)
        return self._agent.initialize_xfer(operation, local_descs, remote_descs, remote_agent, *args, **kwargs)

    def _report(self, peer, src, dst, src_index, dst_index) -> None:
        if src is None or dst is None:
            self._on_write(peer, None, "a descriptor list the verifier cannot read")
            return
        if src_index is not None:
            src = src[np.asarray(src_index, dtype=np.int64)]
            dst = dst[np.asarray(dst_index, dtype=np.int64)]
        if src.shape[0] != dst.shape[0] or (src[:, 1] != dst[:, 1]).any():
            self._on_write(peer, None, f"{src.shape[0]} source and {dst.shape[0]} destination descriptors differ")
            return
        self._on_write(peer, np.column_stack((src[:, 0], dst[:, 0], src[:, 1])), None)


class NixlVerifiedTransferMixin(VerifiedTransferMixin):
    """NIXL's entry: the blocks of each WRITE transfer the manager creates (see the module)."""

    agent = recorded_attribute(
        "_verify_nixl_agent", lambda self, agent: RecordingAgent(agent, self._verify_nixl_write),
        """The manager's NIXL agent; with verification on, wrapped in :class:`RecordingAgent`.

        Contract: SGLang's constructor assigns ``self.agent`` once (both sides) and every
        thread uses it afterwards; the wrapper changes no argument or result.""")

    def _verify_nixl_write(self, peer: str, blocks: Optional[np.ndarray], why: Optional[str]) -> None:
        """One WRITE transfer about to be created (transfer worker thread, prefill). Must
        never raise: a digest that cannot be taken leaves the room unverified."""
        if self.disaggregation_mode.name != "PREFILL":
            return
        try:
            if blocks is None and not peer:  # the decode is unknown: no digest for any of the room's
                room = getattr(self._verify_tls, "room", None)
                for session in list(self.transfer_infos.get(room, {}) or {}) if room is not None else ():
                    self._verify_mark_unplaced(session, why or "unknown blocks")
            elif blocks is None:
                self._verify_mark_unplaced(peer, why or "unknown blocks")
            elif blocks.shape[0]:
                self._verify_add_blocks(peer, blocks)
        except Exception:  # noqa: BLE001 - verification must never fail a transfer by itself
            logger.exception("verified transfers: digest of a NIXL transfer failed; the room goes unverified")
            self._verify_mark_unplaced(peer, "digest raised")
