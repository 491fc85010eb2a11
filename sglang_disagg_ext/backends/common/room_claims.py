"""F16: a second live request with a bootstrap room already in use is refused, on both sides.

SGLang keys a transfer manager's per-request state by ``bootstrap_room`` alone and never checks
that a new request's room is free (upstream sgl-project/sglang#40125; a client that posts to the
two servers itself picks the room). Two live requests with one room share one status and one
slot for decode's page lists on prefill: the second's page lists overwrite the first's, one
request reports Success with another's bytes or none, and once either is cleared the other's next
poll raises ``KeyError`` on the scheduler thread, which ends the server (every release
0.5.10.post1-0.5.23; 0.5.22 and 0.5.23's decode refuse a duplicate only under the ``prefill_complete`` allocation
policy, and then fails the first request's room too).

Here SGLang's sender (prefill) and receiver (decode) classes get :class:`RoomClaimMixin` in front:
the object made for a request *claims* its room in the manager's :class:`..core.room_claims.RoomClaims`.
A claim on a room another live object holds is refused: that object is built by SGLang's own
constructor under a private room number (negative: SGLang's rooms are never negative), so every
table it touches is its own, and it is Failed from birth with the reason (naming the room and the
side). It never sends anything to the peer; SGLang's scheduler sees an ordinary Failed request
(its reason through ``failure_exception``, the client gets an error) and clears it, which drops
only the private entries. The holder is untouched. One ERROR a minute per side (the count held
back in the next), ``requests_refused_total{fix="F16",reason="duplicate bootstrap room"}``.

Composed by ``backends.common.compose`` over whichever sender and receiver classes an ``-ext`` name
routes (the plugin's own or SGLang's).
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Optional

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.core.rate_limit import EveryInterval
from sglang_disagg_ext.core.room_claims import RoomClaims

logger = logging.getLogger("sglang_disagg_ext.rooms")

_LOG = EveryInterval(60.0)
# Private room numbers for refused objects: negative, never reused in a process.
_PRIVATE_ROOMS = itertools.count(1)


class DuplicateBootstrapRoom(RuntimeError):
    """A refused request's error, shaped as SGLang's ``KVTransferError`` (room, reason, and
    ``is_from_another_rank`` False: this rank refused it)."""

    is_from_another_rank = False

    def __init__(self, bootstrap_room: int, failure_reason: str):
        super().__init__(failure_reason)
        self.bootstrap_room, self.failure_reason = bootstrap_room, failure_reason


def claims_of(mgr, side: str) -> RoomClaims:
    """The manager's table of live rooms (made on first use; the scheduler thread makes every
    sender and receiver, so no two threads race to make it)."""
    claims = mgr.__dict__.get("_f16_room_claims")
    if claims is None:
        claims = mgr._f16_room_claims = RoomClaims(side)
    return claims


class RoomClaimMixin:
    """In front of SGLang's sender or receiver class; ``_f16_side`` is "prefill" or "decode"."""

    _f16_side = "?"
    _f16_refusal: Optional[str] = None  # set on a refused request: its reason
    _f16_refused_room: Optional[int] = None  # the room it asked for (its object holds a private one)
    _f16_room: Optional[int] = None  # set on a holder: the room it claimed
    # Of the optional methods overridden here, those SGLang's class defines (with_room_claims).
    _f16_base_defines: frozenset = frozenset()

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, *args, **kwargs):
        """Contract: SGLang makes one per request on the scheduler thread when the request arrives
        (prefill's bootstrap queue, decode's pre-allocation queue), before any poll. SGLang's
        constructor registers the room in the manager (status Bootstrapping); for a refused
        request it must see a room no live request uses, so it gets a private one. Must not raise
        for a duplicate (the scheduler thread would end)."""
        claims = claims_of(mgr, self._f16_side)
        reason = None if bootstrap_room is None else claims.claim(bootstrap_room, self)
        if reason is None:
            self._f16_room = bootstrap_room
            super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
            return
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import CommonKVManager

        self._f16_refusal, self._f16_refused_room = reason, bootstrap_room
        private = -next(_PRIVATE_ROOMS)
        super().__init__(mgr, bootstrap_addr, private, *args, **kwargs)
        # SGLang's base record_failure (a reason in failure_records, nothing else), not the
        # manager's: an engine's override may tell the peer about the room, and this one has none.
        CommonKVManager.record_failure(mgr, private, reason)
        self.conclude_state = KVPoll.Failed
        metrics.count("requests_refused_total", fix="F16", reason="duplicate bootstrap room")
        held = _LOG.admit(self._f16_side)
        if held is not None:
            logger.error("sglang-disagg-ext F16: %s%s", reason,
                         f" ({held} more refused since the last line)" if held else "")

    def poll(self):
        """Contract: scheduler thread, once per request per loop; SGLang ends a Failed request
        through ``failure_exception`` and ``clear``. A refused request is Failed without asking
        the manager (its private room has no peer and no deadline to run)."""
        if self._f16_refusal is not None:
            from sglang.srt.disaggregation.base.conn import KVPoll

            return KVPoll.Failed
        return super().poll()

    # A refused request sends nothing to the peer: not its page lists (decode), not its KV
    # (prefill). Each is called by the scheduler thread at most once per chunk.
    def init(self, *args, **kwargs):
        """Contract: scheduler thread (decode: before ``send_metadata``; prefill: when the room
        is WaitingForInput). A refused request opens no connection."""
        if self._f16_refusal is not None:
            return None
        return super().init(*args, **kwargs)

    def send(self, *args, **kwargs):
        """Contract: prefill scheduler thread, once per chunk. A refused request queues nothing."""
        if self._f16_refusal is not None:
            return None
        return super().send(*args, **kwargs)

    def send_metadata(self, *args, **kwargs):
        """Contract: decode scheduler thread, once its pages are allocated. A refused request
        tells prefill nothing: prefill's page lists for the room stay the holder's."""
        if self._f16_refusal is not None:
            return None
        return super().send_metadata(*args, **kwargs)

    def failure_exception(self):
        """Contract: scheduler thread, once SGLang saw Failed; raises the request's reason (the
        client's error) and releases the object, as SGLang's own does on its newest releases. A
        refused request raises its refusal (every release; some engines' own carry no reason)."""
        if self._f16_refusal is None:
            return super().failure_exception()
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.conclude_state = KVPoll.Failed
        self.clear()
        with self.kv_mgr.failure_lock:
            self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        raise DuplicateBootstrapRoom(self._f16_refused_room, self._f16_refusal)

    def abort(self):
        """Contract: scheduler thread, when the client or SGLang aborts the request. A refused
        request is Failed already and holds nothing; SGLang's abort would record and publish a
        status for its private room."""
        if self._f16_refusal is not None or "abort" not in self._f16_base_defines:
            return None
        return super().abort()

    def clear(self):
        """Contract: scheduler thread, when the request leaves the transfer queues (maybe more
        than once; up to 0.5.11 prefill calls it only where it exists, and NIXL's sender has
        none there: then only the claim goes). SGLang's clear drops the manager's entries for
        this object's room (the private one for a refused request); the holder then gives its
        room up."""
        try:
            if "clear" in self._f16_base_defines:
                return super().clear()
            return None
        finally:
            if self._f16_room is not None:
                claims_of(self.kv_mgr, self._f16_side).release(self._f16_room, self)


def with_room_claims(base: type, side: str) -> type:
    """``base`` (a sender or receiver class) with :class:`RoomClaimMixin` in front."""
    ours = base.__module__.startswith("sglang_disagg_ext.")
    name = base.__name__ if ours else f"{base.__name__}_F16"

    # wraps: the signature stays stock's (callers read it to choose their arguments).
    @functools.wraps(base.__init__)
    def __init__(self, *args, **kwargs):
        RoomClaimMixin.__init__(self, *args, **kwargs)

    return type(name, (RoomClaimMixin, base), {
        "__init__": __init__,
        "_f16_side": side,
        "_f16_base_defines": frozenset(m for m in ("abort", "clear") if releases.class_defines(base, m)),
        "__module__": base.__module__ if ours else __name__,
        "__qualname__": base.__qualname__ if ours else name,
        "__doc__": f"{base.__doc__} With RoomClaimMixin (F16).",
    })
