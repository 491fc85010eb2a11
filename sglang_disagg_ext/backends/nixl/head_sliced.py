"""``nixl-ext`` on 0.5.22 and 0.5.23 (F11): stock ``NixlKVManager`` with narrow changes.

Line numbers below are 0.5.23's; 0.5.22 has the same code (nixl/conn.py:875 hetero-TP prep,
:1656 ``_add_remote_peer``, :3270 the bootstrap thread's log-and-re-raise, :657 the decode
listener; common/conn.py:784 ``apply_prefill_status``), except that its decode listener has
no ``CHUNK_READY`` message (``handle_chunk_ready`` is 0.5.23's: the override below is never
called there) and its ``NixlKVReceiver.poll`` also concludes Success from NIXL notifications,
so a dead listener loses prefill's Failed messages rather than every status.

F4 (head slices, notification keys, memory kinds) is upstream in 0.5.22 and 0.5.23, so
nothing of :mod:`backends.nixl.conn` runs here; this class only adds, on prefill:

* **Registration check** (``_add_remote_peer``, bootstrap thread): before stock
  registers a decode whose attention TP size differs (non-MLA, no DCP relayout),
  its KV and each SWA state component are checked with
  ``core.head_slice.check_head_sliced_pair``. A layout that cannot be sliced is
  refused with one error naming the component, both TP sizes and the head
  counts; stock instead asserts in ``_init_hetero_tp_prep_handle``
  (0.5.23 nixl/conn.py:1311), which kills the bootstrap thread, and every room
  then waits out SGLang's timeouts on both sides.
* **Thread survival**: any other exception stock raises while registering a
  decode (NIXL, memory kinds, ...) is logged with its traceback, counted in
  ``thread_recoveries_total{role="prefill",thread="bootstrap"}``, and that
  decode is refused with the exception as the reason; the bootstrap thread
  goes on (stock logs and re-raises, :3415-3426).
  A refused decode's rooms end Failed at once on both sides (SGLang's own
  status message tells decode). Both, the refusal and the survival, are
  :class:`.registration.RegistrationRefusalMixin`, which F13's class on
  0.5.13-0.5.21 shares, with the head-layout check (``_check_pair``).
* **Decode listener survival** (decode): stock's ``decode_listener_thread``
  (nixl/conn.py:1017-1043) has no handler, and on 0.5.23 it is the only way a
  NIXL decode learns a room's Success or Failed (the ``KV_STATUS`` message;
  ``check_status`` reads nothing else): one exception while handling one
  message ends the thread, and every later room of that decode waits out
  SGLang's waiting timeout. The per-message handlers it calls
  (``apply_prefill_status``, ``handle_chunk_ready``,
  ``handle_abort_ack_message``, ``parse_kv_status_message``) catch an
  unexpected exception instead: logged with its traceback, counted in
  ``thread_recoveries_total{role="decode",thread="decode_listener"}``, the
  message's room (where it names one) ended Failed on decode with the
  exception in the reason, and the loop goes on. Prefill has already
  concluded that room (its status message is what failed here).
* **SWA page lists** (``maybe_send_extra``, transfer worker): prefill's and
  decode's SWA page lists of one request are aligned the way 0.5.23's Mooncake
  aligns them (mooncake/conn.py:2145-2161: SWA is not positional, so the
  longer list is cut to the shorter one's length, leading pages kept; the
  pure rule is ``core.state_plan.align_state_indices``), on copies. Stock NIXL
  fails the request instead: "Head-sliced PD transfer page count mismatch"
  (common/conn.py:1802-1806) across TP sizes, "State index length mismatch"
  (nixl/conn.py:3230-3233) at equal TP, after the KV pages already went out.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVManager

from sglang_disagg_ext import activation_log, metrics
from sglang_disagg_ext.backends.nixl.bootstrap_screen import BootstrapScreenMixin
from sglang_disagg_ext.backends.nixl.registration import RegistrationRefusalMixin
from sglang_disagg_ext.backends.common.shared import report_trim
from sglang_disagg_ext.core.state_plan import ComponentPlan, Route, align_state_indices, state_kind_name
from sglang_disagg_ext.core.thread_survival import failure_reason

logger = logging.getLogger("sglang_disagg_ext.nixl")


class NixlHeadSlicedKVManager(RegistrationRefusalMixin, BootstrapScreenMixin, NixlKVManager):
    """Stock 0.5.22/0.5.23 NIXL manager with F11; see the module docstring."""

    refusal_fix = "F11"

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup (``PrefillBootstrapQueue`` / ``DecodePreallocQueue``
        ``._init_kv_manager``); the registration tables are the mixin's, set before
        the stock constructor starts the bootstrap thread.
        """
        super().__init__(*args, **kwargs)
        activation_log.announce(self)

    # -- decode listener (decode) ----------------------------------------------------------------
    def apply_prefill_status(self, *, bootstrap_room: int, status, prefill_rank: int, failure_reason=None,
                             **kwargs):
        """Stock, but an exception ends the room Failed instead of the listener thread.

        Contract: decode only; stock's ``decode_listener_thread`` calls it for each
        ``KV_STATUS`` message from a prefill rank (Success, Failed or, with deferred
        allocation, WaitingForInput), for rooms it may already have cleared. It must
        not raise: the thread has no handler and is the decode's only source of
        room statuses.
        """
        try:
            return super().apply_prefill_status(bootstrap_room=bootstrap_room, status=status,
                                                prefill_rank=prefill_rank, failure_reason=failure_reason, **kwargs)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._f11_listener_raised("apply_prefill_status", bootstrap_room, exc)
            return None

    def parse_kv_status_message(self, msg):
        """Stock; a message it cannot parse without raising is reported as unparsable (None).

        Contract: decode listener thread, once per message that is not a chunk,
        staging or abort-ack message; returns (room, status, prefill rank, reason)
        or None, on which the loop logs and goes on. Must not raise (see
        :meth:`apply_prefill_status`).
        """
        try:
            return super().parse_kv_status_message(msg)
        except Exception as exc:  # noqa: BLE001
            self._f11_listener_raised("parse_kv_status_message", _room_of(msg, 1), exc)  # KV_STATUS, room
            return None

    def handle_chunk_ready(self, msg) -> bool:
        """Stock; a message whose handling raised counts as consumed (True).

        Contract: decode listener thread, first for every message; True when it
        was a staging ``CHUNK_READY`` message. Must not raise.
        """
        try:
            return super().handle_chunk_ready(msg)
        except Exception as exc:  # noqa: BLE001
            self._f11_listener_raised("handle_chunk_ready", _room_of(msg, 1), exc)
            return True

    def handle_abort_ack_message(self, msg) -> bool:
        """Stock; a message whose handling raised counts as consumed (True).

        Contract: decode listener thread, for every message that was neither a
        chunk nor a staging request; True when it was an abort acknowledgement.
        Must not raise.
        """
        try:
            return super().handle_abort_ack_message(msg)
        except Exception as exc:  # noqa: BLE001
            self._f11_listener_raised("handle_abort_ack_message", None, exc)
            return True

    def _f11_listener_raised(self, where: str, room: Optional[int], exc: BaseException) -> None:
        logger.exception("nixl-ext: decode listener: %s raised for room %s; the room is failed, the listener "
                         "keeps serving", where, room)
        metrics.count("thread_recoveries_total", role="decode", thread="decode_listener")
        if room is None or room not in self.request_status:
            return
        reason = failure_reason(f"nixl-ext (F11) decode listener: {where}", exc)
        try:
            self.record_failure(room, reason)
            NixlKVManager.update_status(self, room, KVPoll.Failed)
        except Exception:  # noqa: BLE001 - never out of the listener
            logger.exception("nixl-ext: could not fail room %s after the listener fault", room)

    # -- SWA page lists (transfer worker) ------------------------------------------------------
    def maybe_send_extra(self, peer_name, prefill_state_indices, dst_state_data_ptrs, dst_state_indices,
                         *args, **kwargs):
        """Stock, on SWA page lists aligned as 0.5.23 Mooncake aligns them.

        Contract: prefill only, on a ``transfer_worker`` thread, for a room's last
        chunk with ``state_indices``, once per non-dummy decode rank after its KV
        handles were posted; returns stock's generator of NIXL handles, which
        the worker drains. ``prefill_state_indices`` (shared by every decode rank
        of the room) and ``dst_state_indices`` (decode's ``send_metadata``
        payload) are never mutated: the aligned lists are copies. Other state
        kinds pass through as stock sends them.
        """
        src, dst = self._f11_align_swa(prefill_state_indices, dst_state_indices)
        return super().maybe_send_extra(peer_name, src, dst_state_data_ptrs, dst, *args, **kwargs)

    def _f11_align_swa(self, prefill_state_indices, dst_state_indices):
        state_types = list(getattr(self.kv_args, "state_types", None) or [])
        src_out: Optional[List] = None
        dst_out: Optional[List] = None
        for i, st in enumerate(state_types):
            if state_kind_name(st) != "swa":
                continue
            if prefill_state_indices is None or i >= len(prefill_state_indices) or dst_state_indices is None:
                continue
            src_i = prefill_state_indices[i]
            dst_i = dst_state_indices[i] if i < len(dst_state_indices) else None
            if src_i is None or dst_i is None or len(src_i) == len(dst_i):
                continue
            src_a, dst_a = align_state_indices(src_i, dst_i)
            if src_out is None:
                src_out, dst_out = list(prefill_state_indices), list(dst_state_indices)
            src_out[i], dst_out[i] = src_a.tolist(), dst_a.tolist()
            report_trim(ComponentPlan(i, "swa", Route.PAGED, src_a, dst_a, len(src_i), len(dst_i)), logger)
        if src_out is None:
            return prefill_state_indices, dst_state_indices
        return src_out, dst_out


def _room_of(msg, index: int = 0) -> Optional[int]:
    """The room a listener message names in frame ``index`` (ASCII digits), else None."""
    try:
        text = bytes(msg[index]).decode("ascii")
    except Exception:  # noqa: BLE001 - a frame that is not a room
        return None
    return int(text) if text.isdigit() else None
