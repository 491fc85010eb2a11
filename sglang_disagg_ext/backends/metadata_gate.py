"""F10: decode's metadata gate gets a deadline.

After a room's KV transfer reports Success, SGLang's decode keeps the request
in its transfer queue until the request's metadata row (the aux buffers the
prefill writes: first output token, cached-token counts, logprobs, the room)
shows the request's room. In 0.5.23 that is ``disaggregation/utils.py::
_apply_metadata_gate`` (:245-260), which turns a Success poll back into
Transferring while ``metadata_buffers.bootstrap_room[index, 0] == 0``. Nothing
bounds the wait: the receiver's ``_poll`` keeps Success once it has seen it,
and its timeouts cover only Bootstrapping and WaitingForInput (common/conn.py
:2591-2611). A lost aux write therefore pins the request and its KV pages
forever (upstream #31800).

What this module installs (:func:`install_metadata_gate_deadline`): the gate
function in ``sglang.srt.disaggregation.utils`` is replaced by
:func:`gate_with_deadline`, which runs the stock gate unchanged and then gives
every request the stock gate held a deadline: SGLang's own waiting timeout
(``envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, the same setting that bounds
Bootstrapping and WaitingForInput), counted from the first time the gate held
it. A request held that long is reported Failed, with a reason naming the room,
the metadata buffer index and the seconds waited recorded on the receiver's
manager (``record_failure``). The decode queue then ends it through its own
Failed path: ``pop_transferred`` calls ``kv_receiver.failure_exception()``,
which raises ``KVTransferError`` carrying that reason, and aborts the request
with "Decode transfer failed ... with exception <reason>" (0.5.23 decode.py
:2861-2889), releases its KV pages and frees its metadata slot.

Why the module attribute: the only callers, ``poll_and_all_reduce`` and
``poll_and_all_reduce_with_staging`` (decode.py imports those two by name and
calls them from ``_poll_with_metadata_gate`` / ``_poll_with_staging``,
:2784-2798), live in ``utils`` itself and look ``_apply_metadata_gate`` up in
the module's globals on every call; no module imports the gate by name. So the
replacement reaches both polling paths, and nothing else changes.

On a multi-rank decode each rank keeps its own clock; the gate runs before the
MIN all-reduce of the polls, so the first rank whose deadline passes fails the
request on every rank in the same iteration and the ranks' queues stay equal.

The gate function, its two callers and the queue's Failed path are the same
from 0.5.13 (utils.py:78; the queue releases KV pages through
``release_kv_cache`` before 0.5.22 instead of ``_release_request``, which this
module never calls), so F10 is live from there.
Releases up to 0.5.12.post1 hold the request inside
``DecodeTransferQueue._commit_transfer_to_req`` instead (``elif actual_room ==
0: return False``, 0.5.12.post1 decode.py:1412-1415); this module does not
patch that method (F10 is "live, not covered" there).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Dict, List

from sglang_disagg_ext import metrics
from sglang_disagg_ext.core.gate_deadline import GateClock, gate_failure_reason

logger = logging.getLogger("sglang_disagg_ext")

_EXT_MARK = "_sglang_disagg_ext_fix"
GATE_MODULE = "sglang.srt.disaggregation.utils"
GATE_NAME = "_apply_metadata_gate"

# GATE_NAME -> the stock gate, while ours is installed.
_originals: Dict[str, object] = {}

# Receiver of each request the gate holds -> when it was first held. Weak: a
# request that leaves the queue (its receiver dropped) takes its entry along.
_clock = GateClock(weakref.WeakKeyDictionary())


def _gate_module():
    import importlib

    return importlib.import_module(GATE_MODULE)


def waiting_timeout_s() -> float:
    """SGLang's waiting timeout, read where SGLang reads it (``sglang.srt.environ.envs``)."""
    from sglang.srt.environ import envs

    return envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()


def _stock_gate():
    gate = _originals.get(GATE_NAME)
    if gate is None:
        gate = getattr(_gate_module(), GATE_NAME)
        if getattr(gate, _EXT_MARK, None):
            raise RuntimeError("sglang-disagg-ext F10: the stock metadata gate was lost (not recorded at install)")
    return gate


def gate_with_deadline(polls, decode_reqs, metadata_buffers, *args, **kwargs) -> None:
    """The stock metadata gate, plus a deadline for every request it holds.

    Contract: decode scheduler thread only, from ``poll_and_all_reduce`` (through
    ``DecodeTransferQueue._poll_with_metadata_gate``) or
    ``poll_and_all_reduce_with_staging`` (``_poll_with_staging``), once per
    ``pop_transferred``, before the polls are MIN-reduced across the attention
    TP group (0.5.13-0.5.19 pass a fourth argument, ``server_args``, for the
    stock gate's fake-transfer check: passed through unchanged, as are any
    later extras). ``polls[i]`` is the raw poll (an ``int`` of ``KVPoll``) of
    ``decode_reqs[i]``, a ``DecodeRequest`` still in the transfer queue with
    its ``kv_receiver`` and ``metadata_buffer_index``; the list is mutated in
    place and nothing is returned. It may assume the caller acts on every
    entry of ``polls`` (a Failed entry is aborted through the queue's Failed
    path, which calls ``kv_receiver.failure_exception()``). It must not block,
    write the metadata buffers or the KV pages, change an entry the stock gate
    left alone, or raise Success; it only turns a Transferring that the stock
    gate produced from a Success into Failed once that request has been held
    for SGLang's waiting timeout, and records the reason on the receiver's
    manager first.
    """
    from sglang.srt.disaggregation.base.conn import KVPoll

    success, transferring, failed = int(KVPoll.Success), int(KVPoll.Transferring), int(KVPoll.Failed)
    entered = list(polls)
    _stock_gate()(polls, decode_reqs, metadata_buffers, *args, **kwargs)
    now = time.monotonic()
    timeout_s = None
    for i, before in enumerate(entered):
        if before != success:
            continue  # the stock gate only holds Success; anything else is not ours to time
        receiver = decode_reqs[i].kv_receiver
        if polls[i] != transferring:
            _clock.release(receiver)  # metadata landed (or a fake transfer): stock lets it through
            continue
        if timeout_s is None:
            timeout_s = waiting_timeout_s()
        hold = _clock.hold(receiver, now, timeout_s)
        if not hold.expired(now):
            continue
        room = receiver.bootstrap_room
        index = decode_reqs[i].metadata_buffer_index
        reason = gate_failure_reason(
            room, index, int(metadata_buffers.bootstrap_room.shape[0]), hold.waited(now), hold.timeout_s
        )
        # Recorded before Failed is reported: the queue reads it back through
        # failure_exception() in this same pop_transferred.
        receiver.kv_mgr.record_failure(room, reason)
        polls[i] = failed
        if _clock.mark_failed(receiver):
            metrics.count("transfer_failures_total", fix="F10", reason="metadata never landed")
            logger.warning("sglang-disagg-ext F10: %s", reason)


setattr(gate_with_deadline, _EXT_MARK, "F10")


# --------------------------------------------------------------------------
# Install / uninstall
# --------------------------------------------------------------------------


def install_metadata_gate_deadline() -> List[str]:
    """Replace SGLang's metadata gate with :func:`gate_with_deadline`. Idempotent.

    Returns what is hooked (``["sglang.srt.disaggregation.utils._apply_metadata_gate"]``).
    The caller decides *whether* to install (``releases.current_policy().is_live("F10")``);
    a release without the gate function (before 0.5.13) is an error here, not a
    silent no-op: F10 must not be marked live for it.
    """
    module = _gate_module()
    try:
        current = getattr(module, GATE_NAME)
    except AttributeError as e:
        raise RuntimeError(
            f"sglang-disagg-ext F10: {GATE_MODULE}.{GATE_NAME} does not exist in this SGLang; "
            "the metadata-gate deadline is only written for releases whose decode gates Success there"
        ) from e
    if current is not gate_with_deadline:
        _originals.setdefault(GATE_NAME, current)
        setattr(module, GATE_NAME, gate_with_deadline)
    hooked = f"{GATE_MODULE}.{GATE_NAME}"
    logger.debug("sglang-disagg-ext F10 hook: %s", hooked)
    return [hooked]


def uninstall_metadata_gate_deadline() -> None:
    """Put back the stock gate (nothing to do, and SGLang not imported, if none was installed)."""
    original = _originals.pop(GATE_NAME, None)
    if original is not None:
        setattr(_gate_module(), GATE_NAME, original)
    _clock.clear()


def installed() -> bool:
    """Whether :func:`gate_with_deadline` is SGLang's metadata gate in this process."""
    if GATE_NAME not in _originals:
        return False
    return getattr(_gate_module(), GATE_NAME) is gate_with_deadline


@contextlib.contextmanager
def metadata_gate_deadline(enabled: bool = True):
    """Run a block with the F10 gate installed (``enabled``) or with the stock gate.

    Restores the previous state afterwards, so tests can compare stock and ext
    in one process.
    """
    was_installed = installed()
    if enabled:
        install_metadata_gate_deadline()
    else:
        uninstall_metadata_gate_deadline()
    try:
        yield
    finally:
        if was_installed:
            install_metadata_gate_deadline()
        else:
            uninstall_metadata_gate_deadline()
