"""F20: decode asks a prefill for its parallel info off decode's scheduler thread.

Stock decode's scheduler thread (``DecodePreallocQueue._ensure_prefill_info``) calls
``CommonKVManager.try_ensure_parallel_info`` once a second for every prefill address with requests
waiting, and stock's lookup is a blocking HTTP GET with a 5 s timeout (``requests.get(url,
timeout=5)``: 0.5.10.post1 common/conn.py:205 ... 0.5.23 :1306). A prefill address that takes the
connection and never answers (a link that drops packets, a wedged bootstrap server) stops every
decode step for 5 s of every 6, for the 15 tries stock makes before it aborts the waiting requests:
about 90 s in which no request on that decode server gets a token (upstream #34865).

The ``-ext`` manager runs the same lookup (stock's, with F14 and F19 inside it where they are live)
on a small pool of threads, at most one lookup in flight per address. The scheduler's call waits
for a lookup it starts at most ``GRACE_S`` (a prefill that answers, in milliseconds, is served at
the same try as by stock) and otherwise answers False ("not yet"), which stock's pending queue
treats as a failed try; a later try reads the lookup's answer once it has ended. Stock's count of
tries is unchanged, so a prefill that never answers has its waiting requests aborted after 15 tries,
about 15 s, with stock's message -- and no decode step waited on it for more than ``GRACE_S``.
Composed outermost over ``try_ensure_parallel_info`` (``backends.common.compose``).
"""

from __future__ import annotations

import concurrent.futures
import threading

FIX = "F20"
# How long the scheduler's call waits for a lookup it has just started (a prefill that answers does
# so in milliseconds; a step is tens of milliseconds on a GPU).
GRACE_S = 0.05
# Lookups in flight at once (one per prefill address; more addresses queue, each bounded by stock's 5 s).
LOOKUP_THREADS = 4


class PrefillLookupOffThreadMixin:
    """Decode side of F20; prefill is unchanged."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Stock's lookup (and the fixes composed inside it), run on a lookup thread.

        Contract: stock decode's scheduler thread calls it (``DecodePreallocQueue._ensure_prefill_info``)
        once a second per prefill address with requests waiting, before any receiver of that address
        is initialised; True means the address's parallel info is in ``prefill_info_table`` (filled by
        the lookup, whose answer is returned only once it has ended, so the scheduler never reads a
        half-filled entry). It must not wait on the peer: it blocks at most ``GRACE_S``. A lookup's
        raise reaches the scheduler as it would from stock (F14, composed inside, raises nothing).
        """
        lookups, lock = self._ext_lookups()
        with lock:
            pending = lookups.get(bootstrap_addr)
            if pending is not None and not pending.done():
                return False
            if pending is not None:
                del lookups[bootstrap_addr]
        if pending is not None:
            return pending.result()
        if bootstrap_addr in self.prefill_info_table:
            return True
        with lock:
            pending = lookups.get(bootstrap_addr)
            if pending is None:
                pending = self._ext_lookup_pool().submit(super().try_ensure_parallel_info, bootstrap_addr)
                lookups[bootstrap_addr] = pending
        try:
            answer = pending.result(timeout=GRACE_S)
        except concurrent.futures.TimeoutError:
            return False
        with lock:
            if lookups.get(bootstrap_addr) is pending:
                del lookups[bootstrap_addr]
        return answer

    def _ext_lookups(self):
        # Made on first use: the stock constructor may already run the scheduler's calls.
        if "_ext_prefill_lookups" not in self.__dict__:
            self.__dict__.setdefault("_ext_prefill_lookups_lock", threading.Lock())
            self.__dict__.setdefault("_ext_prefill_lookups", {})
        return self._ext_prefill_lookups, self._ext_prefill_lookups_lock

    def _ext_lookup_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        pool = self.__dict__.get("_ext_prefill_lookup_pool")
        if pool is None:
            pool = concurrent.futures.ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="ext-prefill-lookup")
            self.__dict__["_ext_prefill_lookup_pool"] = pool
        return pool

