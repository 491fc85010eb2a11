"""``mori-ext`` prefill: a decode's transfer message whose handling raises fails that room
on both sides at once.

Read in every wheel (0.5.10.post1 mori/conn.py:280-305 ... 0.5.23 :866-921): prefill's
bootstrap thread hands each decode's per-room message (``TransferInfo``: room, decode
endpoint and port, pages) to ``_handle_transfer_message``, which catches any exception
from parsing or bookkeeping, logs "Failed to parse transfer info message" and returns.
The room then never reaches WaitingForInput: prefill holds it until its bootstrap
timeout and decode until its waiting timeout (300 s each by default), and decode is
never told why. F3's own handler (0.5.12.x) let a bookkeeping exception out of the
bootstrap loop instead.

Here the handler runs as stock's (or F3's); an exception it logged (caught through a
filter on MoRI's module logger, armed on this thread only during the call) or raised
ends the room Failed on prefill with the exception in the reason and tells the decode
that sent the message, at the endpoint and port of that message, the way the release
tells decode of a failure: ``conclude_failure`` from 0.5.20, ``_notify_decode_for_room``
on 0.5.19, ``notify_decode_status`` before (``releases.features()``). Counted in
``thread_recoveries_total{role="prefill",thread="bootstrap"}``. A message whose room
number cannot be read fails nothing (no room to name); it is logged as stock does. The
filter sees stock's record only if MoRI's logger lets ERROR through; where an operator set
it higher, a room stock caught falls back to stock's timeouts (no worse than stock).
"""

from __future__ import annotations

import logging
import threading
import types
from typing import List, Optional, Tuple

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mori import conn as _conn

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.core.thread_survival import failure_reason, room_of_message

logger = logging.getLogger("sglang_disagg_ext.mori")

WHERE = "mori-ext prefill bootstrap thread: decode's transfer message"
_STOCK_MESSAGE = "Failed to parse transfer info message"


class _LoggedExceptionCatcher(logging.Filter):
    """On MoRI's module logger: keeps the exception of stock's "Failed to parse transfer info
    message" record when this thread armed it. Never drops a record (stock's log stays)."""

    def __init__(self):
        super().__init__()
        self._local = threading.local()

    def arm(self) -> List[BaseException]:
        caught: List[BaseException] = []
        self._local.caught = caught
        return caught

    def disarm(self) -> None:
        self._local.caught = None

    def filter(self, record: logging.LogRecord) -> bool:
        caught = getattr(self._local, "caught", None)
        if caught is not None and record.exc_info and record.msg == _STOCK_MESSAGE:
            caught.append(record.exc_info[1])
        return True


_catcher: Optional[_LoggedExceptionCatcher] = None
_catcher_lock = threading.Lock()


def _installed_catcher() -> _LoggedExceptionCatcher:
    global _catcher
    with _catcher_lock:
        if _catcher is None:
            _catcher = _LoggedExceptionCatcher()
            _conn.logger.addFilter(_catcher)
        return _catcher


def _decode_address(payload: List[bytes]) -> Optional[Tuple[str, int]]:
    """(endpoint, port) of the decode that sent ``payload`` (frames 1 and 2 of every
    release's ``TransferInfo.from_zmq``), or None when unreadable."""
    try:
        return payload[1].decode("ascii"), int(payload[2].decode("ascii"))
    except (IndexError, AttributeError, UnicodeDecodeError, ValueError):
        return None


class TransferInfoFailureMixin:
    """Prefill side of the class it is mixed into; see the module docstring. Cooperative: it
    wraps whatever ``_handle_transfer_message`` the next class defines (stock's or F3's)."""

    def _handle_transfer_message(self, payload: List[bytes]) -> None:
        """Contract: prefill only, on the bootstrap thread, for each decode's per-room message
        (guard checked, payload unparsed), possibly before the scheduler created the room's
        sender. Never raises: a failure of the handling below ends that room Failed on both
        sides; the thread goes on to the next message."""
        catcher = _installed_catcher()
        caught = catcher.arm()
        try:
            super()._handle_transfer_message(payload)
        except Exception as exc:  # noqa: BLE001 - the bootstrap loop must survive it
            caught.append(exc)
        finally:
            catcher.disarm()
        if caught:
            self._fail_transfer_room(payload, caught[0])

    def _fail_transfer_room(self, payload: List[bytes], exc: BaseException) -> None:
        room = room_of_message(payload)
        reason = failure_reason(WHERE, exc)
        metrics.count("thread_recoveries_total", role="prefill", thread="bootstrap")
        if room is None:
            logger.error("%s (room unreadable, nothing failed)", reason)
            return
        logger.error("room %s: %s", room, reason)
        address = _decode_address(payload)
        features = releases.features()
        if not features.mori_sender_notifies_status:  # 0.5.20+: records, marks Failed, tells decode
            self.conclude_failure(bootstrap_room=room, failure_reason=reason,
                                  targets=[address] if address else None)
            return
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        if address is None:
            return  # the sender's poll reports the failure on prefill; no decode to tell
        decode = types.SimpleNamespace(endpoint=address[0], dst_port=address[1])
        if features.mori_conclude_room_failure:  # 0.5.19
            self._notify_decode_for_room(room, KVPoll.Failed, reason, target_infos=[decode])
        else:
            self.notify_decode_status([decode], room, KVPoll.Failed, reason)
