"""F22: a NIXL transfer that never settles no longer holds prefill's transfer worker for ever.

Stock (0.5.20-0.5.23 ``nixl/conn.py`` ``NixlKVManager._await_handles``, one method byte for byte; called by each transfer
worker thread after it posts a room's batch): while every handle of the batch reads ``PROC`` the wait
has no bound ("The wait is unbounded while every handle is still healthy"), spinning on
``time.sleep(0)``. A decode that stops progressing (a stalled or frozen process, a link that stopped
delivering: measured here, a UCX/TCP write to a SIGSTOPped peer reads ``PROC`` for as long as it is
stopped) holds the worker thread, a core, and every room queued to that worker behind it, whichever
decode those rooms are for (rooms are sharded over the workers by decode session).

``-ext`` bounds that wait by SGLang's own waiting timeout (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``,
300 s by default): by then decode has failed the room itself, so nothing is waiting for the batch.
At the bound the wait returns "not settled", and stock's worker takes its own path for a batch that
did not settle: the room ends Failed on prefill with a reason, decode is not told its pages are free
(the writes may still land; with F21 decode holds them), and the worker goes on to its other rooms.
After ``SPIN_S`` of ``PROC`` the wait polls every ``POLL_S`` instead of spinning. The failure side
of the loop (a handle read ``ERR``: bounded by stock's ``NIXL_ERR_SETTLE_TIMEOUT_S``) is stock's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, List, Tuple

logger = logging.getLogger(__name__)

FIX = "F22"
# A healthy batch is read back-to-back this long (a transfer of a few pages settles in microseconds to
# milliseconds), then every POLL_S.
SPIN_S = 0.05
POLL_S = 0.001


def _stock_constants():
    from sglang.srt.disaggregation.nixl import conn

    return conn.NIXL_ERR_SETTLE_TIMEOUT_S, conn.NIXL_ERR_SETTLE_POLL_S


def transfer_deadline_s() -> float:
    """SGLang's waiting timeout, read where SGLang reads it (``sglang.srt.environ.envs``)."""
    from sglang_disagg_ext.backends.common.metadata_gate import waiting_timeout_s

    return float(waiting_timeout_s())


class NixlTransferDeadlineMixin:
    """Prefill side of F22; decode is unchanged."""

    def _await_handles(self, handles: List[Any], *, failure_seen: bool) -> Tuple[bool, bool]:
        """Stock's wait for a posted batch, with a bound while every handle is healthy.

        Contract: a prefill transfer worker thread calls it after posting a room's handles (0.5.20-0.5.23:
        the batch barrier, a staging chunk, and the failure path with ``failure_seen``).
        Returns ``(settled, any_failed)`` as stock: ``(True, _)`` once every handle read ``DONE`` or
        ``ERR``; ``(False, True)`` when a state cannot be read, when handles still run
        ``NIXL_ERR_SETTLE_TIMEOUT_S`` after one failed (stock's bound), and here also when every
        handle still reads ``PROC`` after :func:`transfer_deadline_s`. It must not release or touch
        the handles: a handle not settled may still write into decode's pages.
        """
        settle_s, settle_poll_s = _stock_constants()
        start = time.monotonic()
        healthy_deadline = start + transfer_deadline_s()
        deadline = start + settle_s if failure_seen else None
        while True:
            all_settled = True
            any_failed = failure_seen
            try:
                for handle in handles:
                    state = self.agent.check_xfer_state(handle)
                    if state == "ERR":
                        any_failed = True
                    elif state != "DONE":
                        all_settled = False
            except Exception as e:  # noqa: BLE001 - stock's answer: unreadable counts as running
                logger.warning(f"Failed to read NIXL transfer state: {e}")
                return False, True
            if all_settled:
                return True, any_failed
            now = time.monotonic()
            if not any_failed:
                if now >= healthy_deadline:
                    logger.error(
                        "sglang-disagg-ext F22: a NIXL transfer batch (%d handles) still running after %.0f s "
                        "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT: its decode has failed the room by now); "
                        "the room ends Failed here and this transfer worker goes on to its other rooms. Its "
                        "writes may still land, so its decode is not told the pages are free",
                        len(handles), now - start)
                    from sglang_disagg_ext import metrics

                    metrics.count("transfer_failures_total", fix=FIX,
                                  reason="transfer still running at the waiting timeout")
                    return False, True
                time.sleep(0 if now - start < SPIN_S else POLL_S)
                continue
            # Stock's: this room is already lost; give up on the siblings once the deadline passes.
            if deadline is None:
                deadline = now + settle_s
            elif now >= deadline:
                return False, True
            time.sleep(settle_poll_s)


def with_transfer_deadline(manager: type) -> type:
    """``manager`` with :class:`NixlTransferDeadlineMixin` in front, under its own module and name (the
    activation line, doctor and the tests name the engine's adapter)."""
    return type(manager.__name__, (NixlTransferDeadlineMixin, manager),
                {"__module__": manager.__module__, "__qualname__": manager.__qualname__,
                 "__doc__": f"{manager.__doc__} With F22's transfer deadline."})
