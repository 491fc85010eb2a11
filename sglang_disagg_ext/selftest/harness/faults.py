"""Engine faults for the soak: prefill's transfer engine fails the writes into chosen decode pages.

A link that drops writes, made at the narrowest boundary: the one engine
object a prefill manager holds (``mgr.engine``, SGLang's
``MooncakeTransferEngine``) gets its ``batch_transfer_sync`` / ``transfer_sync``
wrapped on the instance. A call any of whose destination addresses lies in one
of the chosen decode KV pages (of any KV buffer of the decode the call writes to)
moves nothing and returns -1, what the engine returns for a failed transfer;
every other call goes to the real engine unchanged. So exactly the requests
that target those pages meet an engine failure, and what the manager does
next (the room, the peer session, the thread) is SGLang's or the plugin's own
code. Rig only: the runtime never imports this.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

ENGINE_FAILURE = -1


class DroppedWrites:
    """The wrapper's state: which decode pages it fails, and how often it did."""

    def __init__(self, mgr, kv_pages: Iterable[int]):
        self.mgr = mgr
        self.pages = np.asarray(sorted(set(int(p) for p in kv_pages)), dtype=np.int64)
        # Prefill's page bytes per KV buffer: the soak runs one rank a side with the
        # same model on both, so a decode KV page has the same size.
        self.item = int(mgr.kv_args.kv_item_lens[0])
        self.calls_failed = 0
        self.calls_passed = 0
        self._lock = threading.Lock()

    def _regions(self, session_id) -> List[Tuple[int, int]]:
        """(start, end) of every dropped page in every KV buffer of the decode registered
        as ``session_id`` (prefill's table is keyed by the Mooncake session). Only that
        one: a decode that died and restarted leaves its old registration behind, and its
        addresses may lie anywhere in the new process's pages."""
        out = []
        table = getattr(self.mgr, "decode_kv_args_table", None) or {}
        info = table.get(session_id)
        for info in ([info] if info is not None else []):
            ptrs = getattr(info, "dst_kv_ptrs", None)
            if ptrs is None:
                raise RuntimeError(f"decode registration {type(info).__name__} has no dst_kv_ptrs")
            for base in ptrs:
                for p in self.pages.tolist():
                    start = int(base) + p * self.item
                    out.append((start, start + self.item))
        return out

    def hits(self, session_id, dsts, lens) -> bool:
        regions = self._regions(session_id)
        if not regions:
            return False
        d = np.asarray(list(dsts), dtype=np.int64)
        n = np.asarray(list(lens), dtype=np.int64)
        for start, end in regions:
            if np.any((d < end) & (d + n > start)):
                return True
        return False

    def count(self, failed: bool) -> None:
        with self._lock:
            if failed:
                self.calls_failed += 1
            else:
                self.calls_passed += 1

    def report(self) -> Dict[str, int]:
        return {"pages": self.pages.tolist(), "engine_calls_failed": self.calls_failed,
                "engine_calls_passed": self.calls_passed}


def drop_engine_writes(mgr, kv_pages: Iterable[int]) -> DroppedWrites:
    """Fail every engine call of ``mgr`` that writes into decode KV pages ``kv_pages``."""
    state = DroppedWrites(mgr, kv_pages)
    engine = mgr.engine
    batch = getattr(engine, "batch_transfer_sync", None)
    single = getattr(engine, "transfer_sync", None)
    if batch is None and single is None:
        raise RuntimeError(f"{type(engine).__name__} has neither batch_transfer_sync nor transfer_sync")

    if batch is not None:
        def batch_transfer_sync(session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs):
            failed = state.hits(session_id, peer_buffer_addresses, lengths)
            state.count(failed)
            if failed:
                return ENGINE_FAILURE
            return batch(session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs)

        engine.batch_transfer_sync = batch_transfer_sync
    if single is not None:
        def transfer_sync(session_id, buffer, peer_buffer_address, length, *args, **kwargs):
            failed = state.hits(session_id, [peer_buffer_address], [length])
            state.count(failed)
            if failed:
                return ENGINE_FAILURE
            return single(session_id, buffer, peer_buffer_address, length, *args, **kwargs)

        engine.transfer_sync = transfer_sync
    return state


# -- NIXL: every n-th posted transfer fails --------------------------------------------
# NIXL's transfer handles carry no request id on every release (0.5.23 posts prepared
# handles without a notification), and their destination descriptors are opaque
# objects; so the NIXL fault is counted by posts, as a link failing 1 in n writes, and
# the soak judges the failures by count (``selftest.soak.judge``): no more requests may
# fail than transfers were failed, each on both sides with a reason.


class FailedPosts:
    """The NIXL wrapper's state: which posts it failed, and how many it let through.

    ``kind``: count only posts whose notification tag is of that kind (``"aux"``:
    ``<room>_aux...``, the row every prefill rank writes); then ``every`` may be 1
    (every such post fails). Posts of other kinds pass and are not counted.
    """

    def __init__(self, every: int, kind: Optional[str] = None, err_after_s: float = 0.0):
        if every < (1 if kind else 2):
            raise ValueError(f"fail every n-th NIXL post needs n >= 2 (>= 1 with a kind), got {every}")
        self.every = every
        self.kind = kind
        # A failed post reads "PROC" this long before "ERR" (a link's loss is seen late).
        self.err_after_s = float(err_after_s)
        self.failed_at: Dict[int, float] = {}
        # id -> notification kind of each handle ``initialize_xfer`` made (kind runs only).
        self.handle_kinds: Dict[int, Tuple[object, str]] = {}
        self.active = True  # the worker turns it off for the soak's fault-free waves
        # id -> the handle itself: holding it keeps its id from being reused by a later
        # handle (which would then read "ERR" without having been failed).
        self.failed_handles: Dict[int, object] = {}
        self.calls_failed = 0
        self.calls_passed = 0
        self._lock = threading.Lock()

    def note_kind(self, handle, notif_msg) -> None:
        """Remember the notification kind ``handle`` was made with (field 1 of its tag)."""
        try:
            text = bytes(notif_msg).decode("ascii") if isinstance(notif_msg, (bytes, bytearray)) else str(notif_msg)
        except UnicodeDecodeError:
            return
        parts = text.split("_")
        if len(parts) > 1:
            with self._lock:
                self.handle_kinds[id(handle)] = (handle, parts[1])

    def take(self, handle) -> bool:
        """Count one post of ``handle``; True when this one is to fail."""
        with self._lock:
            if self.kind is not None:
                held = self.handle_kinds.get(id(handle))
                if held is None or held[0] is not handle or held[1] != self.kind:
                    return False
            n = self.calls_failed + self.calls_passed + 1
            if n % self.every == 0:
                self.calls_failed += 1
                self.failed_handles[id(handle)] = handle
                self.failed_at[id(handle)] = time.monotonic()
                return True
            self.calls_passed += 1
            return False

    def failed(self, handle) -> bool:
        with self._lock:
            return self.failed_handles.get(id(handle)) is handle

    def state_of_failed(self, handle) -> str:
        """What ``check_xfer_state`` says for a failed ``handle``: "PROC", then "ERR"."""
        with self._lock:
            late = time.monotonic() - self.failed_at.get(id(handle), 0.0) < self.err_after_s
        return "PROC" if late else "ERR"


    def report(self) -> Dict[str, int]:
        out = {"fail_every": self.every, "engine_calls_failed": self.calls_failed,
               "engine_calls_passed": self.calls_passed}
        if self.kind is not None:
            out["fail_kind"] = self.kind
        return out


def fail_nixl_posts(mgr, every: int, kind: Optional[str] = None, err_after_s: float = 0.0) -> FailedPosts:
    """Fail every ``every``-th transfer ``mgr``'s NIXL agent posts (``agent.transfer``).

    A failed post moves nothing and returns "PROC" (posted, in flight), and from then
    on ``check_xfer_state`` reports "ERR" for that handle, what NIXL reports for a
    write the network lost; every other call goes to the agent unchanged. Wrapped on
    the one agent object the manager holds (stock's ``nixl_agent`` or ``nixl-ext``'s
    proxy around it), so what the manager does with the error is its own code.
    Notification-only handles (``send_notif``) are not posts and are never failed.
    With ``kind`` only posts whose notification tag is of that kind are counted
    (``FailedPosts``): ``every=1, kind="aux"`` fails every aux row this rank posts.
    ``err_after_s``: a failed handle reads "PROC" for that long, then "ERR".
    """
    state = FailedPosts(every, kind, err_after_s)
    agent = mgr.agent
    transfer, check = agent.transfer, agent.check_xfer_state
    if kind is not None:
        # The kind is read from the tag a handle was made with: every supported release
        # builds its aux (and KV/state) handles with ``initialize_xfer(..., notif_msg)``.
        initialize = agent.initialize_xfer

        def initialize_xfer(operation, local_descs, remote_descs, remote_agent, notif_msg=b"", *args, **kwargs):
            handle = initialize(operation, local_descs, remote_descs, remote_agent, notif_msg, *args, **kwargs)
            state.note_kind(handle, notif_msg)
            return handle

        agent.initialize_xfer = initialize_xfer

    def transfer_(handle, *args, **kwargs):
        # nixl-ext's notification-only handles (send_notif) are not posts.
        if state.active and type(handle).__name__ != "_NotifOnly" and state.take(handle):
            return "PROC"
        return transfer(handle, *args, **kwargs)

    def check_xfer_state(handle):
        if state.failed(handle):
            return state.state_of_failed(handle)
        return check(handle)

    agent.transfer = transfer_
    agent.check_xfer_state = check_xfer_state
    return state
