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
module never calls).

Releases up to 0.5.12.post1 have no gate function: the request is held inside
``DecodeTransferQueue._commit_transfer_to_req`` (``elif actual_room == 0:
return False``, 0.5.10.post1 decode.py:979, 0.5.11 :1205, 0.5.12.post1
:1412-1415), which runs *after* the MIN all-reduce, on each rank alone. A
deadline there would let one rank give up on a request another rank commits.
So there this module installs 0.5.13's own arrangement instead
(:func:`install_metadata_gate_deadline`, legacy branch): the gate runs before
the all-reduce, as upstream moved it in 0.5.13 (:func:`legacy_metadata_gate`
is that gate, 0.5.13 utils.py:78-94, with the release's own
``decode._is_fake_transfer``), followed by the same deadline. The hook: the
transfer queue's ``pop_transferred`` (0.5.12.post1 decode.py:1482) marks
which queue is polling, and the decode module's ``poll_and_all_reduce`` (the
name ``pop_transferred`` calls, decode.py:1489; the prealloc queue calls it
too, and is left alone) gates that queue's receivers' polls before handing
them to stock's all-reduce. Stock's ``_commit_transfer_to_req`` then only
ever sees Success for a row that landed on every rank. Not covered there: the
opt-in staging path (``SGLANG_DISAGG_STAGING_BUFFER``, ``_poll_with_staging``),
which polls and reduces inside ``utils.poll_and_all_reduce_with_staging``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import weakref
from typing import Dict, List

from sglang_disagg_ext import metrics
from sglang_disagg_ext.backends.common import hooks
from sglang_disagg_ext.core.gate_deadline import GateClock, gate_failure_reason

logger = logging.getLogger("sglang_disagg_ext")

_EXT_MARK = "_sglang_disagg_ext_fix"
GATE_MODULE = "sglang.srt.disaggregation.utils"
GATE_NAME = "_apply_metadata_gate"
# Up to 0.5.12.x (no gate function): the names the legacy branch replaces.
LEGACY_MODULE = "sglang.srt.disaggregation.decode"
LEGACY_POLL_NAME = "poll_and_all_reduce"
LEGACY_POP_NAME = "DecodeTransferQueue.pop_transferred"

# The transfer queue whose pop_transferred is running (legacy branch only).
_polling_queue: contextvars.ContextVar = contextvars.ContextVar("sglang_disagg_ext_polling_queue", default=None)

# GATE_NAME -> the stock gate, while ours is installed.
_originals: Dict[str, object] = {}

# Receiver of each request the gate holds -> when it was first held. Weak: a
# request that leaves the queue (its receiver dropped) takes its entry along.
_clock = GateClock(weakref.WeakKeyDictionary())


def _gate_module():
    import importlib

    return importlib.import_module(GATE_MODULE)


def _legacy_module():
    import importlib

    return importlib.import_module(LEGACY_MODULE)


def legacy_metadata_gate(polls, decode_reqs, metadata_buffers, server_args) -> None:
    """0.5.13's metadata gate (utils.py:78-94), for releases that have none (up to 0.5.12.x).

    Turns a Success into Transferring while the request's metadata row still
    shows room 0, except for a fake transfer (the release's own
    ``decode._is_fake_transfer``). Stock ``_commit_transfer_to_req`` makes the
    same test after the all-reduce (0.5.12.post1 decode.py:1409-1415); here it
    runs before, so every rank of the group agrees.
    """
    from sglang.srt.disaggregation.base.conn import KVPoll

    is_fake = _legacy_module()._is_fake_transfer
    success, transferring = int(KVPoll.Success), int(KVPoll.Transferring)
    for i, poll in enumerate(polls):
        if poll != success:
            continue
        decode_req = decode_reqs[i]
        if is_fake(decode_req.req, server_args):
            continue
        if metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0].item() == 0:
            polls[i] = transferring


class _Answer:
    """A poller that answers one poll value already read (and gated)."""

    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value

    def poll(self) -> int:
        return self.value


def poll_and_all_reduce_gated(pollers, gloo_group, *args, **kwargs):
    """The decode module's ``poll_and_all_reduce``, gating the transfer queue's polls first.

    Contract: decode scheduler thread; the decode module calls it by name from
    ``DecodeTransferQueue.pop_transferred`` (once per call) and from the prealloc
    queue. Only inside a transfer queue's ``pop_transferred`` (see
    :func:`pop_transferred_marked`) and only when ``pollers`` are exactly that
    queue's receivers are the polls read here, gated (:func:`gate_with_deadline`
    over :func:`legacy_metadata_gate`) and handed to stock's function as
    answered values; anything else goes to stock unchanged. It must not block
    or change what stock's all-reduce does with the values.
    """
    stock = _originals[LEGACY_POLL_NAME]
    queue = _polling_queue.get()
    if queue is None:
        return stock(pollers, gloo_group, *args, **kwargs)
    by_receiver = {id(dr.kv_receiver): dr for dr in queue.queue}
    decode_reqs = [by_receiver.get(id(p)) for p in pollers]
    if not pollers or any(dr is None for dr in decode_reqs):
        return stock(pollers, gloo_group, *args, **kwargs)
    polls = [int(p.poll()) for p in pollers]
    gate_with_deadline(polls, decode_reqs, queue.metadata_buffers, queue.scheduler.server_args)
    return stock([_Answer(v) for v in polls], gloo_group, *args, **kwargs)


setattr(poll_and_all_reduce_gated, _EXT_MARK, "F10")


def pop_transferred_marked(self, *args, **kwargs):
    """Stock ``DecodeTransferQueue.pop_transferred``, with this queue marked as the one polling.

    Contract: decode scheduler thread, once per scheduler iteration, on every
    attention-TP rank alike (its all-reduce is a collective). Only marks the
    queue for :func:`poll_and_all_reduce_gated` for the duration of the call;
    stock's code runs unchanged.
    """
    token = _polling_queue.set(self)
    try:
        return _originals[LEGACY_POP_NAME](self, *args, **kwargs)
    finally:
        _polling_queue.reset(token)


setattr(pop_transferred_marked, _EXT_MARK, "F10")


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
    """Give SGLang's metadata gate a deadline (:func:`gate_with_deadline`). Idempotent.

    0.5.13+: replaces ``utils._apply_metadata_gate``; up to 0.5.12.x (no gate
    function, ``releases.features().metadata_gate_function`` False): installs
    0.5.13's gate with the deadline before the all-reduce (the module
    docstring's legacy branch). Returns what is hooked. The caller decides
    *whether* to install (``releases.current_policy().is_live("F10")``).
    """
    from sglang_disagg_ext import releases

    if not releases.features().metadata_gate_function:
        return _install_legacy()
    module = _gate_module()
    current = getattr(module, GATE_NAME)
    if current is not gate_with_deadline:
        _originals.setdefault(GATE_NAME, current)
        setattr(module, GATE_NAME, gate_with_deadline)
    hooked = f"{GATE_MODULE}.{GATE_NAME}"
    logger.debug("sglang-disagg-ext F10 hook: %s", hooked)
    return [hooked]


def _install_legacy() -> List[str]:
    decode = _legacy_module()
    queue_class = decode.DecodeTransferQueue
    if LEGACY_POLL_NAME not in _originals:
        _originals[GATE_NAME] = legacy_metadata_gate  # what gate_with_deadline calls as "the stock gate"
        _originals[LEGACY_POLL_NAME] = getattr(decode, LEGACY_POLL_NAME)
        _originals[LEGACY_POP_NAME] = queue_class.pop_transferred
        setattr(decode, LEGACY_POLL_NAME, poll_and_all_reduce_gated)
        queue_class.pop_transferred = pop_transferred_marked
    hooked = [f"{LEGACY_MODULE}.{LEGACY_POLL_NAME}", f"{LEGACY_MODULE}.{LEGACY_POP_NAME}"]
    logger.debug("sglang-disagg-ext F10 hooks (0.5.13's gate, before the all-reduce): %s", hooked)
    return hooked


def uninstall_metadata_gate_deadline() -> None:
    """Put back the stock gate (nothing to do, and SGLang not imported, if none was installed)."""
    if LEGACY_POLL_NAME in _originals:
        decode = _legacy_module()
        setattr(decode, LEGACY_POLL_NAME, _originals.pop(LEGACY_POLL_NAME))
        decode.DecodeTransferQueue.pop_transferred = _originals.pop(LEGACY_POP_NAME)
        _originals.pop(GATE_NAME, None)
    original = _originals.pop(GATE_NAME, None)
    if original is not None:
        setattr(_gate_module(), GATE_NAME, original)
    _clock.clear()


def installed() -> bool:
    """Whether the F10 deadline gates SGLang's decode transfer queue in this process."""
    if LEGACY_POLL_NAME in _originals:
        return getattr(_legacy_module(), LEGACY_POLL_NAME) is poll_and_all_reduce_gated
    if GATE_NAME not in _originals:
        return False
    return getattr(_gate_module(), GATE_NAME) is gate_with_deadline


@contextlib.contextmanager
def metadata_gate_deadline(enabled: bool = True):
    """A block with the F10 gate in (``enabled``) or the stock gate; what was there is restored after."""
    with hooks.toggled(enabled, installed, install_metadata_gate_deadline, uninstall_metadata_gate_deadline):
        yield
