"""Pure pieces of F10: a deadline for decode's metadata gate.

No SGLang or torch import. After a room's KV transfer reports Success, SGLang's
decode holds the request (poll downgraded to Transferring) until the request's
metadata row shows its room; nothing bounds that wait, so a lost aux write pins
the request and its KV pages forever. The adapter (``backends.common.metadata_gate``)
keeps one :class:`GateClock` per process: the first time the gate holds a
request its clock starts, with the deadline SGLang's own waiting timeout gives
at that moment; once the request has been held that long it ends Failed with
:func:`gate_failure_reason`.
"""

from __future__ import annotations

import dataclasses
from typing import MutableMapping, Optional

# The environment variable SGLang reads its waiting timeout from; named in the
# reason so an operator knows which knob the deadline follows.
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class GateHold:
    """One request held by the gate: since when (monotonic seconds) and for how long at most."""

    since: float
    timeout_s: float
    failed: bool = False  # already reported Failed (the reason is logged once)

    def waited(self, now: float) -> float:
        return max(0.0, now - self.since)

    def expired(self, now: float) -> bool:
        """Whether the hold has lasted the deadline.

        The same comparison SGLang makes for its own waiting timeout
        (``elapsed < waiting_timeout`` keeps waiting), so a timeout of 0 fails
        a request the first time the gate holds it, exactly as SGLang's would.
        """
        return self.waited(now) >= self.timeout_s


class GateClock:
    """When the gate first held each request, keyed by whatever the caller passes.

    ``store`` is the mapping kept (default a plain dict); the adapter passes a
    ``weakref.WeakKeyDictionary`` keyed by the request's receiver, so a request
    that leaves the queue by any path takes its entry with it.
    """

    def __init__(self, store: Optional[MutableMapping] = None):
        self._holds: MutableMapping = {} if store is None else store

    def hold(self, key, now: float, timeout_s: float) -> GateHold:
        """The hold of ``key``; started at ``now`` with ``timeout_s`` if it is not held yet.

        The deadline is fixed when the hold starts: changing the timeout later
        does not move the deadline of a request already held.
        """
        held = self._holds.get(key)
        if held is None:
            held = GateHold(since=now, timeout_s=float(timeout_s))
            self._holds[key] = held
        return held

    def mark_failed(self, key) -> bool:
        """Note that ``key`` was reported Failed; True the first time only.

        The hold stays: until the queue acts on the Failed poll the gate keeps
        reporting it Failed, instead of starting a new deadline.
        """
        held = self._holds.get(key)
        if held is None or held.failed:
            return False
        self._holds[key] = dataclasses.replace(held, failed=True)
        return True

    def release(self, key) -> None:
        """Forget ``key`` (its metadata landed, or it left the gate)."""
        self._holds.pop(key, None)

    def clear(self) -> None:
        self._holds.clear()

    def held(self, key) -> Optional[GateHold]:
        return self._holds.get(key)

    def __len__(self) -> int:
        return len(self._holds)


def gate_failure_reason(room: int, metadata_index: int, metadata_rows: Optional[int], waited_s: float,
                        timeout_s: float) -> str:
    """The failure reason of a request whose metadata never landed.

    Names the component (decode's metadata gate), the room, the metadata buffer
    row it waited on (and how many rows the buffers hold), how long it waited
    and the setting the deadline follows.
    """
    rows = f" of {metadata_rows}" if metadata_rows is not None else ""
    return (
        f"decode metadata gate: room {room}'s KV transfer reported Success but its metadata never landed: "
        f"metadata buffer index {metadata_index}{rows} still shows no room after {waited_s:.1f}s "
        f"(deadline {timeout_s:g}s, {WAITING_TIMEOUT_ENV}); the request is failed so its KV pages are released"
    )
