"""F21: decode never gives a failed request's pages back while prefill may still write to them.

Stock (0.5.21-0.5.23 ``decode.py`` ``DecodeTransferQueue.resolve_deferred_releases``, called once
per scheduler iteration): a request whose transfer failed after decode published its pages is held
until every prefill rank acks that its writes stopped (``kv_mgr.is_abort_release_safe``), or until
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s) has passed, when stock logs
"releasing anyway" and frees the pages for the next request. Prefill withholds its ack exactly when it
cannot prove its write stopped (0.5.23 mooncake/conn.py ``_poison_unsettled_send``: a batch that
timed out may still be running), so a late write lands in another request's KV.

``-ext`` (rule in :mod:`sglang_disagg_ext.core.held_pages`): past the timeout an unacked room of an
``-ext`` manager stays held. Once per timeout period its ``ABORT`` goes out again (SGLang's own
``_send_abort_notification``, a fresh generation) and, off the scheduler thread, decode tries a TCP
connection to each of the room's prefill rank endpoints. The pages go back when the acks come in, or
once every endpoint refuses (the prefill process is gone), or at the operator's
``SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S`` if set (without proof: an ERROR says so). Each held room is
logged once (WARNING) and counted in ``/metrics`` (``kv_holds_total{event}``: held, drained,
peer_gone, limit), and so is how its pages went back. What holding costs: ``core.held_pages``.

The hook reorders nothing: it rewrites the deadline of each held entry before stock's method runs
(infinity, but the original deadline once the prefill is gone or the limit is reached: the rule, not
stock's own clock read, decides when the timeout has passed), so stock's own all-reduce across attention
ranks, release and metrics still decide and record every release.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import socket
import time
from typing import Dict, List, Optional

from sglang_disagg_ext import metrics
from sglang_disagg_ext.backends.common import hooks
from sglang_disagg_ext.core.held_pages import LIMIT_ENV, Verdict, abort_resend_due, parse_limit, verdict

logger = logging.getLogger(__name__)

FIX = "F21"
QUEUE_MODULE = "sglang.srt.disaggregation.decode"
QUEUE_METHOD = "DecodeTransferQueue.resolve_deferred_releases"

_originals: Dict[str, object] = {}
HELD_SINCE = "held_since"  # releases.SGLangFeatures.deferred_release_entry's values
DEADLINE = "deadline"


def _entry_shape() -> str:
    from sglang_disagg_ext import releases

    return releases.features().deferred_release_entry


# A connection attempt to a prefill rank endpoint: refused at once by a host whose process is gone;
# a host that does not answer at all is not proof of anything (held).
PROBE_TIMEOUT_S = 2.0
_probe_pool = None


def endpoints_refuse(endpoints) -> bool:
    """True when every ``(ip, port)`` refuses a TCP connection: no process listens there any more.
    Any endpoint that accepts, times out or fails otherwise makes it False."""
    if not endpoints:
        return False
    for ip, port in endpoints:
        try:
            with socket.create_connection((ip, int(port)), timeout=PROBE_TIMEOUT_S):
                return False
        except ConnectionRefusedError:
            continue
        except OSError:
            return False
    return True


def _look_at(receiver) -> concurrent.futures.Future:
    global _probe_pool
    if _probe_pool is None:
        _probe_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sglang-disagg-ext-F21")
    endpoints = [(info["rank_ip"], info["rank_port"]) for info in (receiver.bootstrap_infos or ())]
    return _probe_pool.submit(endpoints_refuse, endpoints)


def _gone(said) -> bool:
    probe = said.get("probe")
    return probe is not None and probe.done() and probe.exception() is None and probe.result()


def limit_s() -> Optional[float]:
    """The operator's ``SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S`` (None: hold until confirmed; also for an
    invalid value, which ``doctor`` reports as a problem)."""
    try:
        return parse_limit(os.environ.get(LIMIT_ENV))
    except ValueError:
        return None


def invalid_setting() -> Optional[str]:
    """What is wrong with ``SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S``, or None."""
    try:
        parse_limit(os.environ.get(LIMIT_ENV))
    except ValueError as exc:
        return str(exc)
    return None


def _queue_class():
    import importlib

    return importlib.import_module(QUEUE_MODULE).DecodeTransferQueue


def _resend_abort(receiver, mgr, room) -> None:
    # 0.5.21's send re-arms the room's ack table (a fresh set, meant for a room reused by a later
    # request) and its acks carry no generation: the ranks that already acked this request's ABORT
    # would be forgotten and must ack again. They stay counted (0.5.22+ key acks by generation
    # instead; their table entry is not a set).
    tracker = getattr(mgr, "_deferred_abort_ack_tracker", {})
    before = tracker.get(room)
    counted = set(before) if isinstance(before, set) else None
    try:
        receiver._send_abort_notification()
    except Exception:  # noqa: BLE001 - a resend is best effort, as stock's first send
        logger.debug("sglang-disagg-ext F21: ABORT for room %s not re-sent", room, exc_info=True)
    after = tracker.get(room)
    if counted and isinstance(after, set):
        after.update(counted)


def _unpack(entry, shape: str, said: dict, timeout_s: float):
    """-> (decode_req, held_since, metadata_idx, required_acks) of an entry of either shape
    (``releases.SGLangFeatures.deferred_release_entry``). A 0.5.19-0.5.21 entry has no hold start: it
    is its deadline less the timeout (``_defer_release``), read at the first look and kept, since the
    hook rewrites that deadline."""
    if shape == HELD_SINCE:
        decode_req, held_since, _, metadata_idx, required_acks = entry
        return decode_req, held_since, metadata_idx, required_acks
    decode_req, deadline, metadata_idx, required_acks = entry
    held_since = said.setdefault("held_since", deadline - timeout_s)
    return decode_req, held_since, metadata_idx, required_acks


def _entry(shape: str, decode_req, held_since: float, deadline: float, metadata_idx, required_acks) -> tuple:
    if shape == HELD_SINCE:
        return (decode_req, held_since, deadline, metadata_idx, required_acks)
    return (decode_req, deadline, metadata_idx, required_acks)


def _held_entry(queue, entry, now: float, limit: Optional[float], shape: str):
    """``entry`` of ``queue._deferred_releases`` with its deadline rewritten by the F21 rule."""
    decode_req = entry[0]
    receiver = decode_req.kv_receiver
    mgr = getattr(receiver, "kv_mgr", None)
    # Stock's rule for a stock manager (a process running stock and -ext side by side: the tests), and
    # for host destinations (stock never times those out; 0.5.23's ``_is_host_destination`` is this
    # expression, 0.5.21 and 0.5.22 write it out). Every -ext manager class lives in the plugin's
    # modules (its own, or compose's over SGLang's).
    if not type(mgr).__module__.startswith("sglang_disagg_ext.") or (
            getattr(queue, "enable_host_receive", False) and getattr(decode_req, "host_staged", False)):
        return entry
    timeout_s = queue.deferred_kv_release_timeout
    said = receiver.__dict__.setdefault("_ext_f21", {})
    decode_req, held_since, metadata_idx, required_acks = _unpack(entry, shape, said, timeout_s)
    room = decode_req.req.bootstrap_room
    addr = getattr(receiver, "bootstrap_addr", None)
    drained = mgr.is_abort_release_safe(room, required_acks)
    decided = verdict(now=now, held_since=held_since, timeout_s=timeout_s, drained=drained, prefill_gone=_gone(said),
                      limit_s=limit)
    if decided is Verdict.HOLD:
        if "held" not in said:
            said["held"] = now
            logger.warning(
                "sglang-disagg-ext F21: keeping room %s's pages past the %.0f s deferred release timeout: "
                "prefill %s has not confirmed (%d of %d ranks) that its writes to them stopped; they go back "
                "when it does or once that prefill's process is gone", room, timeout_s, addr,
                _acks(mgr, room), required_acks)
            metrics.count("kv_holds_total", event="held")
        if abort_resend_due(now=now, held_since=held_since, timeout_s=timeout_s, last_sent=said.get("resent")):
            said["resent"] = now
            _resend_abort(receiver, mgr, room)
            if said.get("probe") is None or said["probe"].done():
                said["probe"] = _look_at(receiver)
        return _entry(shape, decode_req, held_since, math.inf, metadata_idx, required_acks)
    if "held" in said and "released" not in said:
        said["released"] = decided.value
        if decided is Verdict.PEER_GONE:
            logger.warning(
                "sglang-disagg-ext F21: giving back room %s's pages after %.1f s: every rank endpoint of "
                "prefill %s refuses connections (its process is gone), so none of its writes can land",
                room, now - held_since, addr)
            metrics.count("kv_holds_total", event="peer_gone")
        elif decided is Verdict.LIMIT:
            logger.error(
                "sglang-disagg-ext F21: giving back room %s's pages after %.1f s WITHOUT proof that prefill %s's "
                "writes to them stopped (%s=%s): a write that lands later lands in another request's KV",
                room, now - held_since, addr, LIMIT_ENV, os.environ.get(LIMIT_ENV))
            metrics.count("kv_holds_total", event="limit")
        else:
            logger.info("sglang-disagg-ext F21: room %s's pages go back after %.1f s: prefill confirmed its "
                        "writes stopped", room, now - held_since)
            metrics.count("kv_holds_total", event="drained")
    if decided in (Verdict.PEER_GONE, Verdict.LIMIT):
        return _entry(shape, decode_req, held_since, held_since + timeout_s, metadata_idx, required_acks)
    # STOCK: acked (stock releases it whatever its deadline) or before the timeout. Its deadline is put out
    # of reach too: stock's method reads the clock again after this one, and a room whose timeout falls
    # between the two reads would go back "anyway" (seen under load in CI: released at 1.0006 s).
    return _entry(shape, decode_req, held_since, math.inf, metadata_idx, required_acks)


def _acks(mgr, room) -> int:
    state = getattr(mgr, "_deferred_abort_ack_tracker", {}).get(room)
    if state is None:
        return 0
    return len(state) if isinstance(state, set) else len(state.prefill_ranks)  # 0.5.21 a set of ranks


def resolve_deferred_releases_held(self) -> None:
    """Stock's ``resolve_deferred_releases`` with each held entry's deadline set by the F21 rule.

    Contract: stock decode's scheduler calls it once per iteration (``decode.py`` event loop), on
    every attention rank; ``self._deferred_releases`` holds the tuples ``_defer_release`` appends
    (0.5.22+ ``(decode_req, held_since, deadline, metadata_idx, required_acks)``, 0.5.21 the same
    without ``held_since``). It must release nothing itself (stock's method, with 0.5.23's all-reduce
    across ranks, does) and must not raise.
    """
    if self._deferred_releases:
        now = time.monotonic()
        try:
            limit = limit_s()  # once per call, not per held entry
            shape = _entry_shape()
            self._deferred_releases = [_held_entry(self, entry, now, limit, shape) for entry in self._deferred_releases]
        except Exception:  # noqa: BLE001 - never stop the scheduler; stock's rule then decides
            logger.exception("sglang-disagg-ext F21: held-page check failed; SGLang's own rule decides")
    return _originals[QUEUE_METHOD](self)


def install_held_pages() -> List[str]:
    """Put :func:`resolve_deferred_releases_held` in place of stock's method. Idempotent. The caller
    decides whether (``releases.current_policy().is_live("F21")``)."""
    queue_class = _queue_class()
    if QUEUE_METHOD not in _originals:
        _originals[QUEUE_METHOD] = queue_class.resolve_deferred_releases
        queue_class.resolve_deferred_releases = resolve_deferred_releases_held
    return [f"{QUEUE_MODULE}.{QUEUE_METHOD}"]


def uninstall_held_pages() -> None:
    """Put back stock's method (nothing to do, and SGLang not imported, if none was installed)."""
    original = _originals.pop(QUEUE_METHOD, None)
    if original is not None:
        _queue_class().resolve_deferred_releases = original


def installed() -> bool:
    return QUEUE_METHOD in _originals and _queue_class().resolve_deferred_releases is resolve_deferred_releases_held


@contextlib.contextmanager
def held_pages(enabled: bool = True):
    """A block with the F21 hook in (``enabled``) or stock's method; what was there is restored after."""
    with hooks.toggled(enabled, installed, install_held_pages, uninstall_held_pages):
        yield
