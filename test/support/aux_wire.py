"""Test-only prefill hooks (``SGLANG_HARNESS_PREFILL_HOOK``) for MoRI's metadata rows (F12).

Loaded by the harness worker in the prefill process right after the manager
exists. They live here, outside the wheel.

* ``delay_aux_rows``: the boundary between SGLang and the wire. Every ZMQ
  message whose first frame is ``AUX_DATA`` (a metadata row, 0.5.23
  mori/conn.py:1617) leaves its socket ``SGLANG_TEST_AUX_DELAY_MS`` late, and
  every later message on *that* socket queues behind it: one socket is one TCP
  connection, which keeps its order; two sockets have none. Nothing else is
  changed. This is a slow link for the socket that carries the rows: stock
  sends rows and status on different sockets, ``mori-ext`` on one.
* ``shorter_aux_rows``: the prefill's row size of metadata buffer 1 is 4 bytes
  shorter than decode's (``kv_args.aux_item_lens[1]``), as a prefill built with
  a different metadata layout would have it; set before any request.
"""

import collections
import os
import threading
import time
import weakref

DELAY_ENV = "SGLANG_TEST_AUX_DELAY_MS"
AUX_HEADER = b"AUX_DATA"
SHORTER_BUFFER = 1
SHORTER_BY = 4


class _Link:
    """One socket's outgoing messages, sent in order by one thread, each not before its due time."""

    def __init__(self, sock, send):
        self._sock, self._send = sock, send
        self._queue = collections.deque()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="test-aux-delay").start()

    def put(self, parts, args, kwargs, due: float) -> None:
        with self._cv:
            self._queue.append((due, parts, args, kwargs))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                due, parts, args, kwargs = self._queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                self._send(self._sock, parts, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a closed socket at teardown
                print(f"test-aux-delay: send failed: {exc!r}", flush=True)
            with self._cv:
                self._queue.popleft()


def delay_aux_rows(mgr) -> None:
    import zmq

    delay = float(os.environ.get(DELAY_ENV, "30")) / 1000.0
    original = zmq.Socket.send_multipart
    links = weakref.WeakKeyDictionary()
    lock = threading.Lock()

    def send_multipart(self, msg_parts, *args, **kwargs):
        is_row = bool(msg_parts) and bytes(msg_parts[0]) == AUX_HEADER
        with lock:
            link = links.get(self)
            if link is None and is_row:
                link = links[self] = _Link(self, original)
        if link is None:
            return original(self, msg_parts, *args, **kwargs)
        link.put(list(msg_parts), args, kwargs, time.monotonic() + (delay if is_row else 0.0))
        return None

    zmq.Socket.send_multipart = send_multipart


def shorter_aux_rows(mgr) -> None:
    lens = list(mgr.kv_args.aux_item_lens)
    lens[SHORTER_BUFFER] -= SHORTER_BY
    mgr.kv_args.aux_item_lens = lens
