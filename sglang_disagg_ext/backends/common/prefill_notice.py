"""Decode tells a prefill it refused (F14, F19) that its requests are over, so prefill ends them at once.

Stock decode never tells such a prefill: its half of every refused request waits in Bootstrapping
until prefill's bootstrap timeout (300 s by default), and SGLang's router answers the client only
then, once per try. ``PrefillRefusals`` (F14's and F19's table) hands the rooms it fails to
:meth:`PrefillNotice._ext_tell_prefill`, which, off the scheduler thread, asks the prefill's bootstrap
server once for its ranks (``GET /route``, as decode's own receivers do) and sends each rank's
bootstrap socket an ``ABORT`` for each room, at the times of ``core.prefill_notice.SEND_AT_S``.
Only a prefill whose answer shows it takes ABORT (``core.prefill_notice.takes_abort``: 0.5.22 on)
is told; an older one is named once in a WARNING, and its requests end at its bootstrap timeout as
before. A notice that cannot be sent changes nothing else: decode has already failed the rooms.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Dict, List, Sequence

from sglang_disagg_ext.core import prefill_notice

logger = logging.getLogger("sglang_disagg_ext.prefill_notice")

# Seconds the prefill's ranks are remembered (as a refusal is: prefill_pairing.RECHECK_S).
ENDPOINTS_TTL_S = 30.0
HTTP_TIMEOUT_S = 5.0


class PrefillNotice:
    """Decode side: the ABORT notices for rooms decode refused before they reached prefill's engine."""

    def _ext_tell_prefill(self, bootstrap_addr: str, rooms: Sequence[int]) -> None:
        """Queue the notice; returns at once (callers run on decode's scheduler thread)."""
        if rooms:
            self._ext_notice_state()[2].submit(self._ext_send_notices, bootstrap_addr, tuple(rooms))

    def _ext_notice_state(self):
        """(lock, prefill address -> (endpoints, when asked), the notices' executor), made on first
        use: the stock constructor may already run the scheduler's calls."""
        if "_ext_notice_executor" not in self.__dict__:
            self.__dict__.setdefault("_ext_notice_lock", threading.Lock())
            self.__dict__.setdefault("_ext_notice_endpoints", {})
            self.__dict__.setdefault("_ext_notice_executor", concurrent.futures.ThreadPoolExecutor(
                2, thread_name_prefix="ext-prefill-notice"))
        return self._ext_notice_lock, self._ext_notice_endpoints, self._ext_notice_executor

    def _ext_send_notices(self, bootstrap_addr: str, rooms: Sequence[int]) -> None:
        try:
            endpoints = self._ext_prefill_endpoints(bootstrap_addr)
            if not endpoints:
                return
            import zmq

            context = zmq.Context.instance()
            sockets = []
            try:
                for address in endpoints:
                    sock = context.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 1000)
                    sock.setsockopt(zmq.SNDTIMEO, 1000)
                    sock.connect(address)
                    sockets.append(sock)
                start = time.monotonic()
                for at in prefill_notice.SEND_AT_S:
                    time.sleep(max(0.0, start + at - time.monotonic()))
                    for sock in sockets:
                        for room in rooms:
                            sock.send_multipart(list(prefill_notice.abort_frames(room)))
            finally:
                for sock in sockets:
                    sock.close()
            logger.info("told prefill %s (%d rank(s)) that decode refused room(s) %s", bootstrap_addr,
                        len(endpoints), ", ".join(str(r) for r in rooms))
        except Exception as exc:  # noqa: BLE001 - a notice is best effort; decode already failed the rooms
            logger.warning("could not tell prefill %s that decode refused room(s) %s: %s: %s (prefill ends "
                           "them at its bootstrap timeout)", bootstrap_addr, list(rooms), type(exc).__name__, exc)

    def _ext_prefill_endpoints(self, bootstrap_addr: str) -> List[str]:
        """The ZMQ addresses of the prefill's ranks ([] for a prefill that takes no ABORT), asked once
        per ``ENDPOINTS_TTL_S``."""
        lock, known_endpoints, _ = self._ext_notice_state()
        with lock:
            known = known_endpoints.get(bootstrap_addr)
        if known is not None and time.monotonic() - known[1] < ENDPOINTS_TTL_S:
            return known[0]
        import requests

        base = f"http://{bootstrap_addr}/route"
        answer = requests.get(base, params={"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1,
                                            "target_pp_rank": -1}, timeout=HTTP_TIMEOUT_S).json()
        endpoints: List[str] = []
        if not prefill_notice.takes_abort(answer):
            logger.warning("prefill %s cannot be told that decode refused its requests (its release takes no "
                           "ABORT message, before SGLang 0.5.22): each ends at prefill's bootstrap timeout",
                           bootstrap_addr)
        else:
            for query in prefill_notice.rank_queries(answer):
                rank: Dict[str, object] = requests.get(base, params=query, timeout=HTTP_TIMEOUT_S).json()
                endpoints.append(prefill_notice.endpoint(rank))
        with lock:
            known_endpoints[bootstrap_addr] = (endpoints, time.monotonic())
        return endpoints
