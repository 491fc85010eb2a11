"""F21: when decode may give a failed request's pages back (pure rule, no SGLang import).

Stock decode (0.5.22+) holds the device pages of a request whose transfer failed after it published
them to prefill, sends prefill an ``ABORT`` and waits for every prefill rank's drain ack
(``ABORT_ACK``: "my writes to those pages have stopped"). At ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
(30 s) without the acks it gives the pages back anyway; a write that lands later lands in another
request's KV. Prefill withholds the ack exactly when it cannot prove its write stopped (a Mooncake
batch that timed out still running, ``_poison_unsettled_send``), and an older prefill never sends one.

The ``-ext`` rule, past the timeout with acks missing:

* every rank endpoint of the prefill that was given the pages refuses a TCP connection: the process
  that bound it is gone, and with it its TCP streams and RDMA queue pairs, so none of its writes can
  land -> ``PEER_GONE``, give the pages back. Decode's heartbeat declaring a prefill dead is not
  enough: a prefill whose scheduler is stalled (paused, swapping, a long GC) fails its health checks
  and writes again when it wakes; its sockets still accept connections;
* otherwise -> ``HOLD``: keep them, and send the ``ABORT`` again (and look at the endpoints again)
  every timeout period: a lost ``ABORT`` or ack, or a prefill restarted at the same address, then
  acks and the pages go back.

Before the timeout, or once the acks are in, stock's rule decides (``STOCK``).

The cost: pages a prefill never confirms stay out of the pool, and SGLang counts a decode holding
any as not idle (``Scheduler`` idle checks: ``flush_cache``, the idle leak check), until that
prefill acks or exits, as SGLang already does for host destinations. Stock's Mooncake prefill never
acks a room whose send failed (it cannot prove the batch stopped). An operator who would rather
have the pages back may set ``LIMIT_ENV`` (seconds from the hold's start): at the limit the pages go
back (``LIMIT``), with an ERROR that says it was done without proof.
"""

from __future__ import annotations

import enum
import math
from typing import Optional

LIMIT_ENV = "SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S"


class Verdict(str, enum.Enum):
    STOCK = "stock"  # before the timeout, or every ack in: SGLang's own rule decides
    HOLD = "hold"  # past the timeout, prefill not gone and silent: the pages stay out of the pool
    PEER_GONE = "peer gone"  # past the timeout, every prefill rank endpoint refuses connections: release
    LIMIT = "limit"  # past the operator's LIMIT_ENV, unconfirmed: release without proof


def parse_limit(raw: Optional[str]) -> Optional[float]:
    """``LIMIT_ENV``'s value: None when unset or empty (hold until confirmed), else seconds > 0.
    Raises ValueError naming the variable for anything else."""
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{LIMIT_ENV}={raw!r}: expected seconds > 0, or unset to hold pages until prefill confirms")
    return value


def verdict(*, now: float, held_since: float, timeout_s: float, drained: bool, prefill_gone: bool,
            limit_s: Optional[float] = None) -> Verdict:
    """``now`` and ``held_since`` on one clock (the queue's ``time.monotonic``); ``prefill_gone``: the last
    look at the room's prefill rank endpoints found every one refusing connections; ``limit_s``: the
    operator's limit on a hold (``LIMIT_ENV``), never earlier than stock's timeout."""
    if drained or now < held_since + timeout_s:
        return Verdict.STOCK
    if prefill_gone:
        return Verdict.PEER_GONE
    if limit_s is not None and now >= held_since + limit_s:
        return Verdict.LIMIT
    return Verdict.HOLD


def abort_resend_due(*, now: float, held_since: float, timeout_s: float, last_sent: Optional[float]) -> bool:
    """Whether a held room's ``ABORT`` goes out again (and its endpoints are looked at again): one
    timeout period after stock's own (at the hold's start) and after each resend."""
    return now >= (held_since if last_sent is None else last_sent) + timeout_s
