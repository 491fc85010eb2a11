"""F14: a prefill that cannot pair with this decode fails its own requests; the decode keeps serving.

Stock decode asks each prefill for its parallel info (page size, KV dtype, KV layout, TP/CP/PP
sizes) the first time a request names that prefill's bootstrap address, and checks it in
``CommonKVManager.try_ensure_parallel_info``: a mismatch raises (``RuntimeError``, or an
``AssertionError`` from the rank mapping) on decode's scheduler thread, which has no handler, so
the decode process exits with every request it was serving. One misconfigured prefill in a
router's pool takes down every decode the router sends its requests to.

The ``-ext`` manager makes the same call and the same checks. Where they raise, it refuses that
prefill address: one ERROR naming the address and stock's message (which names both values),
every request waiting for that address ends Failed at once with that reason (decode's scheduler
then answers it with an error, as for any failed transfer), and so does every later request to
it, without asking it again, until the refusal is ``RECHECK_S`` old; then the next request asks
again (a prefill restarted with the right flags is served). Every other prefill is served as
before. Composed over every engine's ``-ext`` manager where F14 is live (every release with a CI
leg: the check raises in every wheel), by ``backends.common.compose``. The table of refused
prefills (:class:`PrefillRefusals`) is shared with F19, which refuses a prefill on a newer release.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Tuple

from sglang_disagg_ext import metrics
from sglang_disagg_ext.backends.common.prefill_notice import PrefillNotice

logger = logging.getLogger("sglang_disagg_ext.prefill_pairing")

FIX = "F14"
# Seconds a refused prefill address is answered from memory before it is asked again.
RECHECK_S = 30.0
# KVPoll.Failed (the same value in every release).
_FAILED = 0


class PrefillRefusals(PrefillNotice):
    """Decode's table of refused prefill addresses, shared by F14 and F19 (each refuses for its own
    reason; a refused address is answered from memory for ``RECHECK_S``). The rooms it fails are
    also ended on prefill (``prefill_notice``), which stock never tells."""

    def _ext_answer_refused(self, bootstrap_addr: str) -> bool:
        """True (and every room waiting for the address Failed) while its refusal is fresh."""
        refusals = self._ext_refusals()
        with self._ext_refusals_lock:
            refused = refusals.get(bootstrap_addr)
        if refused is not None and time.monotonic() - refused[1] < RECHECK_S:
            self._ext_fail_rooms_of(bootstrap_addr, refused[0], refused[2])
            return True
        return False

    def _ext_refuse_prefill(self, bootstrap_addr: str, reason: str, fix: str, metric_reason: str) -> None:
        """Refuse the address: one ERROR per address and reason, its waiting rooms Failed."""
        refusals = self._ext_refusals()
        with self._ext_refusals_lock:
            first = bootstrap_addr not in refusals or refusals[bootstrap_addr][0] != reason
            refusals[bootstrap_addr] = (reason, time.monotonic(), (fix, metric_reason))
        if first:
            logger.error("%s (decode keeps serving every other prefill; asked again after %.0f s)", reason, RECHECK_S)
        self._ext_fail_rooms_of(bootstrap_addr, reason, (fix, metric_reason))

    def _ext_refusals(self) -> Dict[str, Tuple[str, float, Tuple[str, str]]]:
        # Made on first use: the stock constructor may already run the scheduler's calls.
        if "_ext_refused_prefills" not in self.__dict__:
            self.__dict__.setdefault("_ext_refusals_lock", threading.Lock())
            self.__dict__.setdefault("_ext_refused_prefills", {})
        return self._ext_refused_prefills

    def _ext_fail_rooms_of(self, bootstrap_addr: str, reason: str, counted: Tuple[str, str]) -> None:
        """End every room waiting for ``bootstrap_addr`` Failed with ``reason`` (decode's receivers
        read it: ``failure_exception`` raises it, and SGLang answers the request with it)."""
        rooms = list(self.addr_to_rooms_tracker.get(bootstrap_addr, ()))
        failed = []
        for room in rooms:
            try:
                if self.check_status(room) == _FAILED:
                    continue
            except KeyError:  # concluded and cleared meanwhile
                continue
            self.record_failure(room, reason)
            self.update_status(room, _FAILED)
            metrics.count("requests_refused_total", fix=counted[0], reason=counted[1])
            failed.append(room)
        self._ext_tell_prefill(bootstrap_addr, failed)


class PrefillPairingMixin(PrefillRefusals):
    """Decode side of F14; prefill is unchanged."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Stock's lookup and checks, with a refusal instead of a raise.

        Contract: stock decode's scheduler thread calls it (``DecodePreallocQueue._ensure_prefill_info``)
        for every prefill bootstrap address that has requests waiting, at most once a second per
        address, before any receiver of that address is initialised; True means the address's
        parallel info is in ``prefill_info_table``. The requests waiting for the address are the
        rooms of ``addr_to_rooms_tracker[bootstrap_addr]``. It must not raise (that ends the decode
        process) and must not block longer than stock's own query does.
        """
        if self._ext_answer_refused(bootstrap_addr):
            return False
        try:
            return super().try_ensure_parallel_info(bootstrap_addr)
        except Exception as exc:  # noqa: BLE001 - any raise here ends the decode process
            reason = (f"prefill {bootstrap_addr} cannot pair with this decode, its requests are refused: "
                      f"{type(exc).__name__}: {exc}")
            self._ext_refuse_prefill(bootstrap_addr, reason, FIX, "prefill cannot pair with this decode")
            return False
