"""``mori-ext`` (F12): stock ``MoriKVManager`` with the metadata rows ordered (0.5.20-0.5.23) and checked
(every release; on 0.5.12.x ``mori-ext``'s classes are F3's, which carry the same row checks).

Line numbers below are 0.5.23's. 0.5.22 has the same metadata path (``send_aux_tcp``
:1556, ``_send_aux_data_to_endpoint`` :1577, ``_handle_aux_data`` :1932, the common
status push over ``_send_multipart_locked``) and the same registration frames
(``KVArgsRegisterInfo.from_zmq`` reads positions 1-16 after the guard, :224-259), but no
``build_receiver_registration_message`` hook: there the receiver sends the message itself
(``MoriKVReceiver._register_kv_args``, :2165-2217), and the row-size frame is appended to
that message on its way out (:meth:`MoriOrderedKVReceiver._register_kv_args`). 0.5.20 and
0.5.21 are 0.5.22's shape (the functions above byte-identical, status through
``conclude_transfer`` -> ``send_kv_status_message`` -> ``_send_multipart_locked``), except
that their registration has 13 frames after the guard (``from_zmq`` reads positions 1-12,
0.5.21 mori/conn.py:203-237): the count is read from the installed wheel
(``releases.features().mori_registration_frames``), never assumed.

F3 (per-component state) is upstream in 0.5.23, so nothing of :mod:`backends.mori.conn`
runs here. SGLang's default ("TCP") metadata path sends each metadata buffer's
row of a request as an ``AUX_DATA`` message from a per-thread ZMQ socket
(``send_aux_tcp`` / ``_send_aux_data_to_endpoint`` over ``_connect_threadsafe``,
0.5.23 mori/conn.py:837-857, :1585-1624) and the room's status from another
socket (``send_kv_status_message`` over ``_send_multipart_locked``,
common/conn.py:1709-1716). Two sockets are two TCP connections with no order
between them, so decode can apply Success before that room's rows are written
and hand the request a stale metadata row. The decode also drops, with one log
line, a row whose bytes disagree with their declared length (:1971-1984), and
writes a row of the wrong size over the next row or short of its tail.

What this module changes:

* **One ordered channel** (prefill, transfer worker): the rows go out on the
  same per-endpoint socket, under the same lock, as the room's status. The
  status of a room is sent after its rows (same thread, ``_process_transfer_chunk``
  concludes after ``_submit_kv_transfer`` returns), ZMQ keeps one socket's
  messages in order, and decode's one status thread writes each row before it
  reads the next message: Success is applied only after the rows landed. A stock
  decode gets the same order (it handles messages one by one too).
* **Rows checked, never dropped** (``core.aux_rows``): the decode appends its
  row sizes to its registration; the prefill checks every row of a room against
  them before sending any, and a mismatch fails the room on both sides (SGLang's
  ``conclude_failure`` sends Failed with the reason, which names the buffer, the
  row and both lengths). The decode checks every row it receives the same way
  and fails the room with the reason instead of writing or dropping it.
* **Stock prefill refused at registration** (decode): a stock prefill still
  sends rows and status on two sockets, which this decode cannot put back in
  order (it does not know whether that prefill sends rows over TCP or through
  the engine). Before registering, the decode asks the prefill's bootstrap
  server for ``ORDER_ROUTE`` (served by :class:`MoriOrderedKVBootstrapServer`
  only) and fails the request with the reason when it is missing.
* **A status message whose handling raises** (decode): stock's decode
  status worker (0.5.23 mori/conn.py:1007-1042, the same loop from 0.5.20) catches
  any exception from ``apply_prefill_status``, logs it and goes on, but leaves the
  room as it was: prefill has concluded it, decode holds it until SGLang's waiting
  timeout (300 s by default). Here that room ends Failed on decode at once with
  the exception in the reason, counted in
  ``thread_recoveries_total{role="decode",thread="status_worker"}``.
* **A decode's transfer message whose handling raises** (prefill, every
  release): :mod:`.transfer_info`; that room ends Failed on both sides at once.

With ``SGLANG_MORI_SEND_AUX_RDMA=1`` rows go through the engine and the status
waits for them (stock), so only the length check of the prefill path applies.

Up to 0.5.19 (``releases.features().mori_sender_notifies_status``) stock's shape
differs: the last chunk's rows go out through stock's ``send_aux_tcp`` and the
status later through ``notify_decode_status`` (from the scheduler thread up to
0.5.12.x, from the thread that sent the rows, a transfer worker, from 0.5.13; a
failure through the sender up to 0.5.18); there is no ``conclude_failure`` and
the decode worker handles each status inline. There this class checks the rows on both sides as
above, but leaves stock's channel (``send_aux_tcp`` hands the checked rows to
stock's): from 0.5.12.post1 rows and status leave on one ``_connect_threadsafe``
socket from one thread (ordered), and on 0.5.10.post1/0.5.11, which open a new
socket per message, the harness's delay hook could not make the status overtake a
row. A row refused on prefill is recorded and concluded Failed the way that
release concludes a failure (:mod:`.aux_rows`), which sends Failed with the
reason to decode. A stock prefill is served there
(no ``ORDER_ROUTE`` probe); the decode still checks every row it receives. The
registration frame follows stock's 11 frames on 0.5.10.post1/0.5.11, 13 on
0.5.12.post1-0.5.21 (``mori_registration_frames``).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mori import conn as _conn

from sglang_disagg_ext import activation_log, metrics, releases
from sglang_disagg_ext.backends.mori.aux_rows import AuxRowCheckMixin
from sglang_disagg_ext.backends.mori.transfer_info import TransferInfoFailureMixin
from sglang_disagg_ext.backends.common.shared import probe_prefill_version, register_appending
from sglang_disagg_ext.core.aux_rows import encode_aux_item_lens
from sglang_disagg_ext.core.thread_survival import failure_reason as thread_failure_reason

logger = logging.getLogger("sglang_disagg_ext.mori")

FIX = "F12"
ORDER_ROUTE = "/sglang_disagg_ext/mori_aux_order"
ORDER_VERSION = 1
PROBE_TIMEOUT_S = 5.0
# SGLang's registration message is the guard, then the frames KVArgsRegisterInfo.from_zmq
# reads (the first of them the room field "None"): 17 on 0.5.22/0.5.23 (0.5.23
# mori/conn.py:2098-2117), 13 on 0.5.20/0.5.21. Read from the wheel, once per process.


def stock_registration_frames() -> int:
    return releases.features().mori_registration_frames

REGISTRATION_ROOM = b"None"


class MoriOrderedKVManager(TransferInfoFailureMixin, AuxRowCheckMixin, _conn.MoriKVManager):
    """Stock MoRI manager with F12 (every release but 0.5.12.x); see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup. The stock constructor starts the bootstrap thread
        (prefill) or the decode status thread, which call ``_handle_register_message``
        and ``_handle_aux_data``: every field they read is set before ``super().__init__``.
        """
        self._prefill_order: Dict[str, Optional[str]] = {}
        super().__init__(*args, **kwargs)
        activation_log.announce(self)

    # -- registration --------------------------------------------------------------------------------
    def build_receiver_registration_message(self) -> List[bytes]:
        """Stock registration plus one frame with this decode's metadata row sizes (0.5.23;
        before 0.5.23 SGLang never calls it: the receiver appends the frame instead).

        Contract: decode scheduler thread, from ``CommonKVReceiver._register_kv_args``
        the first time this manager meets a prefill. A stock prefill reads the
        frames by position (``KVArgsRegisterInfo.from_zmq``) and ignores the extra one.
        """
        return super().build_receiver_registration_message() + [encode_aux_item_lens(self.kv_args.aux_item_lens)]

    def _handle_register_message(self, payload: List[bytes]) -> None:
        """Stock registration, then the decode's row sizes if it sent them.

        Contract: prefill bootstrap thread, for each message whose room frame is
        ``None``; ``payload`` is the message without the guard. Must not raise
        (stock logs and goes on); a malformed size frame is logged and the peer
        is served with this side's row sizes as the reference.
        """
        super()._handle_register_message(payload)
        self._note_aux_lens(payload, stock_registration_frames())

    # -- decode: a status message whose handling raises -------------------------------------------------
    def apply_prefill_status(self, *, bootstrap_room: int, status, prefill_rank: int, failure_reason=None,
                             **kwargs):
        """Stock, but an exception fails the room on decode instead of leaving it to the timeout.

        Contract: decode only; stock's decode status worker calls it for each status
        message of a prefill rank (Success or Failed), in socket order after that
        room's metadata rows, possibly for a room it already cleared. Stock's loop
        logs an exception and reads the next message; the room it was about would
        then wait out SGLang's waiting timeout although prefill concluded it. Must
        not raise.
        """
        try:
            return super().apply_prefill_status(bootstrap_room=bootstrap_room, status=status,
                                                prefill_rank=prefill_rank, failure_reason=failure_reason, **kwargs)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            logger.exception("mori-ext: decode status worker: apply_prefill_status raised for room %s; the room "
                             "is failed, the worker keeps serving", bootstrap_room)
            metrics.count("thread_recoveries_total", role="decode", thread="status_worker")
            if bootstrap_room not in self.request_status:
                return None  # cleared: a record now would be adopted by a later room of that number
            reason = thread_failure_reason("mori-ext decode status worker: apply_prefill_status", exc)
            try:
                self.record_failure(bootstrap_room, reason)
                # The class's method, not an instance attribute: the fault may be in the latter.
                _conn.MoriKVManager.update_status(self, bootstrap_room, KVPoll.Failed)
            except Exception:  # noqa: BLE001 - never out of the worker
                logger.exception("mori-ext: could not fail room %s after the status fault", bootstrap_room)
            return None

    # -- decode: is the prefill on the ordered channel? -------------------------------------------------
    def prefill_order_problem(self, bootstrap_addr: str) -> Optional[str]:
        """``None`` when the prefill behind ``bootstrap_addr`` runs F12 (or cannot be
        asked right now), else why this decode must not register there."""
        if bootstrap_addr in self._prefill_order:
            return self._prefill_order[bootstrap_addr]
        answered, version = probe_prefill_version(bootstrap_addr, ORDER_ROUTE, "aux_order_version",
                                                  PROBE_TIMEOUT_S, logger)
        if not answered:
            return None
        if version is None:
            problem = (
                f"the prefill behind bootstrap server {bootstrap_addr} runs stock `mori`, which sends "
                "metadata rows and the room's status on two sockets (SGLang mori/conn.py send_aux_tcp): "
                "this decode could report Success before the metadata lands. Start the prefill with "
                "--disaggregation-transfer-backend mori-ext too"
            )
        else:
            problem = None if version == ORDER_VERSION else (
                f"the prefill behind bootstrap server {bootstrap_addr} speaks metadata order v{version}, "
                f"this decode v{ORDER_VERSION}: run the same sglang_disagg_ext on both sides"
            )
        self._prefill_order[bootstrap_addr] = problem
        if problem:
            logger.error("mori-ext: %s", problem)
        return problem


class MoriOrderedKVReceiver(_conn.MoriKVReceiver):
    def _register_kv_args(self) -> bool:
        """Stock registration; where the manager has no registration hook (0.5.20-0.5.22), with
        this decode's metadata row sizes appended as one frame.

        Contract: decode scheduler thread, from stock ``init`` the first time this
        receiver meets its prefill ranks; sends one registration message per prefill
        rank through ``_connect_to_bootstrap_server``. Stock's frames go out unchanged
        and in order (a stock prefill reads positions 1-16 and ignores the extra one).
        """
        if releases.features().mori_registration_hook:
            return super()._register_kv_args()  # the manager's hook adds the frame (0.5.23)
        frame = encode_aux_item_lens(self.kv_mgr.kv_args.aux_item_lens)
        return register_appending(self, frame, _is_registration, super()._register_kv_args)

    def init(self, prefill_dp_rank: int):
        """Contract: decode scheduler thread, once per request, once the prefill DP
        rank is known. The probe before stock ``init`` blocks at most
        ``PROBE_TIMEOUT_S`` and is cached per prefill after a definite answer.
        Never raises: a refused prefill ends the request Failed with the reason.
        """
        # Up to 0.5.19 a stock prefill sends rows and status in stock's order (module docstring),
        # so there it is served; this decode still checks every row it receives.
        legacy = releases.features().mori_sender_notifies_status
        problem = None if legacy else self.kv_mgr.prefill_order_problem(self.bootstrap_addr)
        if problem is not None:
            if self.bootstrap_room is not None:
                self.kv_mgr.record_failure(self.bootstrap_room, f"mori-ext refused at registration: {problem}")
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            metrics.count("requests_refused_total", fix=FIX, reason="stock_prefill")
            self.conclude_state = KVPoll.Failed
            return
        super().init(prefill_dp_rank)


class MoriOrderedKVBootstrapServer(_conn.MoriKVBootstrapServer):
    """SGLang's bootstrap server plus ``ORDER_ROUTE``: a decode can tell this
    prefill sends metadata rows ahead of the status on one channel."""

    def _setup_routes(self):
        """Contract: stock ``CommonKVBootstrapServer.__init__`` calls it once, in the
        prefill's tokenizer-manager process, before the server thread starts.
        Only add routes; keep stock's.
        """
        super()._setup_routes()
        self.app.router.add_get(ORDER_ROUTE, self._handle_order)

    async def _handle_order(self, request):
        from aiohttp import web

        return web.json_response({"plugin": "sglang_disagg_ext", "backend": "mori-ext", "aux_order_version": ORDER_VERSION})


def _is_registration(frames) -> bool:
    """A stock registration message: the guard, the room field "None", then the other frames
    ``from_zmq`` reads (16 on 0.5.22/0.5.23, 12 on 0.5.20/0.5.21)."""
    return (len(frames) == 1 + stock_registration_frames() and bytes(frames[0]) == _conn.MORI_GUARD
            and bytes(frames[1]) == REGISTRATION_ROOM)


def ext_classes() -> Dict[str, type]:
    return {
        "MoriKVManager": MoriOrderedKVManager,
        "MoriKVReceiver": MoriOrderedKVReceiver,
        "MoriKVBootstrapServer": MoriOrderedKVBootstrapServer,
    }
