"""``nixl-ext`` prefill: a decode whose registration cannot be served is refused, not fatal.

Shared by F11's class (0.5.22, 0.5.23: :mod:`.nixl_newest`) and F13's
(0.5.13-0.5.21: :mod:`.nixl_swa_tp`). In every release 0.5.13-0.5.23 stock
NIXL's prefill bootstrap thread registers each decode rank by calling
``_add_remote_peer`` from its one receive loop (0.5.13 nixl/conn.py:1857,
0.5.21 :3057, 0.5.23 :3415-3426), with no handler around it (0.5.21-0.5.23
wrap the loop only to log and re-raise). One exception while registering one
decode rank (NIXL metadata, memory kinds, a head layout stock asserts on)
ends the thread: no later registration or room message of *any* decode is
read, and every room waits out SGLang's timeouts.

Here, on prefill:

* ``_add_remote_peer`` runs the class's pair check (:meth:`_check_pair`: F11
  checks head-sliced layouts; none by default) and then stock's registration.
  A check that refuses, or any exception stock raises, refuses that decode
  rank with one error naming it and the reason (an exception is logged with
  its traceback and counted in
  ``thread_recoveries_total{role="prefill",thread="bootstrap"}``); the
  thread goes on.
* A refused decode's rooms end Failed on prefill at once: when the bootstrap
  thread marks such a room ready (``update_status(WaitingForInput)``) it is
  concluded Failed instead, and a room that became ready before prefill
  created it is failed when the scheduler sends its first chunk
  (``add_transfer_request``). Decode is told through SGLang's own status
  message where the release has one (``conclude_failure``, 0.5.20+); up to
  0.5.19 no NIXL message tells decode of a failure, so it ends such a room by
  its waiting timeout, as for any prefill-side failure there.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Optional, Tuple

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.core.head_slice import HeadLayoutError
from sglang_disagg_ext.core.thread_survival import root_cause

logger = logging.getLogger("sglang_disagg_ext.nixl")


class RegistrationRefusalMixin:
    """Refuses, instead of dying on, a decode registration it cannot serve; see the module docstring."""

    # The fix the refusals are counted under (requests_refused_total{fix=...}).
    refusal_fix = "F11"

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup. The stock constructor starts prefill's bootstrap thread,
        which calls ``_add_remote_peer`` and ``update_status``: every field they read
        is set before ``super().__init__``.
        """
        self._refused_lock = threading.Lock()
        # decode agent name -> (its TP rank, why it cannot be served), refused at registration
        self._refused: Dict[str, Tuple[int, str]] = {}
        super().__init__(*args, **kwargs)

    # -- registration (bootstrap thread) -------------------------------------------------
    def _add_remote_peer(self, decode_kv_args):
        """Stock registration, after the class's pair check; never raises.

        Contract: stock ``bootstrap_thread`` calls it on prefill for every
        registration message (room ``None``) of a decode rank, parsed by
        ``KVArgsRegisterInfo.from_zmq``; an agent name already in
        ``decode_kv_args_table`` is ignored by stock. It runs on the one
        bootstrap thread that also serves every other decode's messages, so it
        must not raise (stock's raise ends that thread) and must not block.
        """
        name = decode_kv_args.agent_name
        if self.disaggregation_mode != DisaggregationMode.PREFILL or name in self.decode_kv_args_table:
            return super()._add_remote_peer(decode_kv_args)
        rank = getattr(decode_kv_args, "decode_tp_rank", -1)
        try:
            rank = int(rank)
            self._check_pair(decode_kv_args)
        except HeadLayoutError as exc:
            self._refuse(name, rank, f"decode TP rank {rank} refused at registration: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 - a bug in the check must not end the thread either
            self._registration_raised(name, rank, exc)
            return None
        try:
            return super()._add_remote_peer(decode_kv_args)
        except Exception as exc:  # noqa: BLE001 - keep the bootstrap thread alive; refuse this decode
            self._registration_raised(name, rank, exc)
            return None

    def _check_pair(self, info) -> None:
        """Raise HeadLayoutError for a decode this prefill cannot serve (default: none)."""

    def _registration_raised(self, name: str, rank, exc: BaseException) -> None:
        root = root_cause(exc)
        logger.exception("nixl-ext: registering decode %s (TP rank %s) raised; refusing it, the bootstrap "
                         "thread keeps serving", name, rank)
        metrics.count("thread_recoveries_total", role="prefill", thread="bootstrap")
        self._refuse(name, rank, f"decode TP rank {rank} refused: its registration raised {type(root).__name__}: {root}")

    def _refuse(self, name: str, rank, reason: str) -> None:
        rank = rank if isinstance(rank, int) else -1  # the sort key of _room_refusal
        with self._refused_lock:
            self._refused[name] = (rank, reason)
        logger.error("nixl-ext: decode %s: %s", name, reason)

    def _room_refusal(self, room: int) -> Optional[str]:
        """The refusal of the lowest refused decode rank this room sends to (None: none refused)."""
        if not self._refused:
            return None
        # Snapshot: the bootstrap thread may add a late peer while we walk it.
        refusals = [
            self._refused[info.agent_name]
            for info in list((self.transfer_infos.get(room) or {}).values())
            if not _is_dummy(info) and info.agent_name in self._refused
        ]
        # The lowest rank's, so both sides of every room name the same one.
        return min(refusals)[1] if refusals else None

    def _fail_room(self, room: int, reason: str) -> None:
        metrics.count("requests_refused_total", fix=self.refusal_fix, reason="decode refused at registration")
        if releases.features().nixl_conclude_failure:
            # SGLang's own conclusion: records the reason, marks the room Failed and
            # sends Failed with the reason to every decode rank of the room.
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return
        # Up to 0.5.19: what a failure on prefill does there (no message reaches decode).
        self.record_failure(room, reason)
        super().update_status(room, KVPoll.Failed)

    # -- rooms ---------------------------------------------------------------------------
    def update_status(self, bootstrap_room: int, status: KVPoll):
        """Stock, except that a ready room of a refused decode concludes Failed instead.

        Contract: called from every thread of the manager (scheduler: sender
        init/abort; bootstrap thread: a room's decode infos are complete ->
        ``WaitingForInput``; transfer workers: progress and conclusions). Only
        that bootstrap-thread case is changed, and only for a room already
        created by its sender (stock refuses to resurrect a room it has not
        seen); it must not raise or block.
        """
        if (
            status == KVPoll.WaitingForInput
            and self._refused
            and bootstrap_room in self.request_status
            and self.request_status.get(bootstrap_room) != KVPoll.Failed
        ):
            reason = self._room_refusal(bootstrap_room)
            if reason is not None:
                self._fail_room(bootstrap_room, reason)
                return None
        return super().update_status(bootstrap_room, status)

    def add_transfer_request(self, bootstrap_room: int, *args, **kwargs):
        """Stock, but a room of a refused decode concludes Failed instead of being queued.

        Contract: prefill scheduler thread, ``NixlKVSender.send`` per chunk. The
        room reaches it only when it became ready before its sender existed
        (``update_status`` could not fail it then). Stock would queue the chunk
        for a transfer worker, which asserts the decode is registered. Never raise.
        """
        reason = self._room_refusal(bootstrap_room)
        if reason is not None:
            if self.request_status.get(bootstrap_room) != KVPoll.Failed:
                self._fail_room(bootstrap_room, reason)
            return None
        return super().add_transfer_request(bootstrap_room, *args, **kwargs)


def _is_dummy(info) -> bool:
    """Whether a room's decode rank receives nothing (a method up to 0.5.19, a field after)."""
    if releases.features().nixl_is_dummy_method:
        return bool(info.is_dummy())
    return bool(getattr(info, "is_dummy", False))
