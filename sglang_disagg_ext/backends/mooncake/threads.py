"""F8 mixin for ``mooncake-ext``: no transfer-path thread dies silently.

Stock Mooncake runs three long-lived loops per manager: prefill's
``transfer_worker`` (one per transfer queue; it re-raises every exception as
"Transfer thread failed ... Prefill instance ... is dead."), prefill's
bootstrap thread and decode's thread (closures built in
``start_prefill_thread`` / ``start_decode_thread``, with no handler at all).
One unexpected exception kills the loop, and every request behind it waits for
SGLang's timeouts. Here an exception tied to one chunk or one message ends that
chunk's / message's room Failed (prefill: status plus SGLang's own sync of
Failed to decode; decode: its status) with the exception in the reason, and
the same stock loop is entered again. No stock loop body is copied:

* ``transfer_worker``: the stock loop runs on a view of its queue that
  remembers the chunk it handed out last; after an exception with a chunk in
  flight, that chunk's room is failed and the stock loop is re-entered.
* bootstrap / decode thread: while the stock ``start_*_thread`` runs, the
  ``threading`` name of SGLang's Mooncake module resolves to a view whose
  ``Thread`` wraps the targets created on this thread in a supervisor (all
  else goes to the real module; the name is restored before the call returns).
  ``server_socket`` becomes a view whose ``recv_multipart`` remembers, per
  thread, the message being handled; after an exception the supervisor fails
  that message's room and re-enters the stock closure.

An exception with nothing in flight (a dead socket, an error in ``queue.get``)
is not tied to any request; it is re-raised and the thread ends as in stock,
rather than spin.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics
from sglang_disagg_ext.backends.mooncake.peers import conclude_room_failed
from sglang_disagg_ext.core.thread_survival import failure_reason, room_of_message

logger = logging.getLogger("sglang_disagg_ext.mooncake.threads")


class _TrackedQueue:
    """One transfer queue as its worker sees it: ``get`` remembers the chunk it returned."""

    def __init__(self, queue):
        self._queue = queue
        self.current = None

    def get(self, *args, **kwargs):
        self.current = None  # a failure inside get() itself is tied to no chunk
        item = self._queue.get(*args, **kwargs)
        self.current = item
        return item

    def __getattr__(self, name):  # put (staging re-enqueue), qsize, ...
        return getattr(self._queue, name)


class _RecordingSocket:
    """``server_socket`` as the message loops see it: remembers, per thread, the last message."""

    def __init__(self, socket, in_flight: threading.local):
        self._socket = socket
        self._in_flight = in_flight

    def recv_multipart(self, *args, **kwargs):
        self._in_flight.msg = None
        msg = self._socket.recv_multipart(*args, **kwargs)
        self._in_flight.msg = msg
        return msg

    def __getattr__(self, name):  # close, bind, getsockopt, ...
        return getattr(self._socket, name)


class _SupervisingThreading:
    """The ``threading`` module, except that ``Thread`` targets created by ``owner`` are supervised."""

    def __init__(self, real, owner: int, supervise):
        self._real = real
        self._owner = owner
        self._supervise = supervise

    def Thread(self, *args, target=None, **kwargs):  # noqa: N802 - stands in for threading.Thread
        if target is not None and self._real.get_ident() == self._owner:
            target = self._supervise(target)
        return self._real.Thread(*args, target=target, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


class ThreadSurvivalMixin:
    """F8: see the module docstring. Cooperative; composed before the manager class."""

    # Decode messages whose room is in frame 1, after the tag.
    _ROOM_TAGS = (MooncakeKVManager.AUX_DATA_HEADER,)

    # -- prefill transfer worker ---------------------------------------------
    def transfer_worker(self, queue, executor, *args, **kwargs):
        """Stock ``transfer_worker``, re-entered after an exception on a chunk.

        Contract: prefill only. SGLang's constructor starts one thread per
        transfer queue with this as target (positional ``queue, executor`` then
        release-specific extras, passed through unchanged); the loop ``get``s
        ``TransferKVChunk``s that ``add_transfer_request`` put on the scheduler
        thread, until ``teardown`` puts ``None`` (0.5.23; older loops never
        return). Must not return while the stock loop would keep serving, must
        not hold any lock across the stock loop, and must not swallow an
        exception that no chunk is tied to.
        """
        tracked = _TrackedQueue(queue)
        while True:
            try:
                return super().transfer_worker(tracked, executor, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the stock loop wraps everything in RuntimeError
                chunk, tracked.current = tracked.current, None
                if chunk is None:
                    raise
                metrics.count("thread_recoveries_total", role="prefill", thread="transfer_worker")
                self._f8_fail_room(getattr(chunk, "room", None), failure_reason("Mooncake transfer worker", exc))

    # -- bootstrap / decode message threads -----------------------------------
    def start_prefill_thread(self):
        """Stock ``start_prefill_thread``, its bootstrap loop supervised.

        Contract: prefill only; SGLang's constructor calls it once, on the
        scheduler thread, after ``server_socket`` is bound and before the
        transfer workers start. The loop it starts reads ``server_socket`` (or
        0.5.23's ``_make_worker_recv(server_socket)``) and runs until the
        process ends (0.5.23: until ``teardown`` sets ``_stopped``). Must start
        exactly the threads stock starts, and leave ``threading`` as it found it.
        """
        self._f8_supervised_start(super().start_prefill_thread)

    def start_decode_thread(self):
        """Stock ``start_decode_thread``, its message loop supervised.

        Contract: decode only; SGLang's constructor calls it once, on the
        scheduler thread, last. It starts the decode message loop (status, aux
        data, staging messages from prefill) and the heartbeat checker. Same
        rules as ``start_prefill_thread``. The heartbeat loop handles no message,
        so an exception there is re-raised, as in stock.
        """
        self._f8_supervised_start(super().start_decode_thread)

    def _make_worker_recv(self, socket, *args, **kwargs):
        """Stock ``_make_worker_recv`` on the real socket, remembering each message.

        Contract: 0.5.23 and later only (older releases have none and never call
        it): the stock ``start_*_thread`` calls it once, on the scheduler
        thread, with ``self.server_socket``; the returned callable runs on the
        loop thread and returns a message or None (poll timeout). The ZMQ poller
        needs the real socket, so the view is unwrapped here.
        """
        if isinstance(socket, _RecordingSocket):
            socket = socket._socket
        recv = super()._make_worker_recv(socket, *args, **kwargs)
        in_flight = self._f8_in_flight

        def recording_recv():
            in_flight.msg = None
            msg = recv()
            in_flight.msg = msg
            return msg

        return recording_recv

    def _f8_supervised_start(self, start) -> None:
        self._f8_in_flight = threading.local()
        if not isinstance(self.server_socket, _RecordingSocket):
            self.server_socket = _RecordingSocket(self.server_socket, self._f8_in_flight)
        conn = sys.modules[MooncakeKVManager.__module__]
        real = conn.threading
        conn.threading = _SupervisingThreading(real, threading.get_ident(), self._f8_supervise)
        try:
            start()
        finally:
            conn.threading = real

    def _f8_supervise(self, target):
        in_flight = self._f8_in_flight
        where = f"Mooncake {self._f8_role()} {getattr(target, '__name__', 'message')} thread"

        @functools.wraps(target)  # keeps the thread's name ("Thread-N (bootstrap_thread)")
        def supervised():
            while True:
                in_flight.msg = None
                try:
                    return target()
                except Exception as exc:  # noqa: BLE001 - one bad message must not end the loop
                    msg = getattr(in_flight, "msg", None)
                    if msg is None or getattr(self, "_stopped", False):
                        raise
                    room = room_of_message(msg, self._ROOM_TAGS)
                    reason = failure_reason(where, exc)
                    metrics.count("thread_recoveries_total", role=self._f8_role(),
                                  thread=getattr(target, "__name__", "message"))
                    if room is None:
                        logger.error("%s: a message naming no room (%d frames) was dropped", reason, len(msg))
                    else:
                        self._f8_fail_room(room, reason)

        return supervised

    # -- failing one room -------------------------------------------------------
    def _f8_role(self) -> str:
        return "prefill" if self.disaggregation_mode == DisaggregationMode.PREFILL else "decode"

    def _f8_fail_room(self, room, reason: str) -> None:
        """End ``room`` Failed with ``reason``; on prefill, tell its decode ranks. Never raises."""
        logger.error("room %s: %s", room, reason)
        try:
            if room is None or room not in self.request_status:
                return  # cleared (or never known here): nothing waits on it
            if self.disaggregation_mode != DisaggregationMode.PREFILL:
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)
                return
            conclude_room_failed(self, room, reason)
        except Exception:  # noqa: BLE001 - failing the room must not end the loop either
            logger.exception("room %s: could not end the room Failed after: %s", room, reason)
