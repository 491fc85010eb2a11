"""Pure pieces of F8 (transfer-path threads survive unexpected exceptions).

No SGLang or torch import: the Mooncake adapter (``backends.mooncake.threads``)
uses these to name the room a failed message or chunk belonged to and to word
the failure reason both sides report.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

# Longest exception chain followed; a chain is normally 1-2 deep (SGLang's
# transfer worker wraps the real exception in a RuntimeError).
_MAX_CHAIN = 8


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s ``__cause__``/``__context__`` chain.

    Stock ``transfer_worker`` re-raises every exception as ``RuntimeError("Transfer
    thread failed because of ...")``; the reason must name what actually failed.
    """
    seen = {id(exc)}
    for _ in range(_MAX_CHAIN):
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
    return exc


def failure_reason(where: str, exc: BaseException) -> str:
    """The room's failure reason: which thread, the real exception's type and text."""
    root = root_cause(exc)
    return f"{where} raised {type(root).__name__}: {root}; the room is failed, the thread keeps serving"


def _ascii_int(frame) -> Optional[int]:
    if not isinstance(frame, (bytes, bytearray)):
        return None
    try:
        text = bytes(frame).decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text or not text.lstrip("-").isdigit():
        return None
    return int(text)


def room_of_message(frames: Optional[Sequence], tags: Iterable[bytes] = ()) -> Optional[int]:
    """The bootstrap room a ZMQ multipart message is about, or None if it names none.

    SGLang's Mooncake messages carry the room as ASCII digits in frame 0 (decode's
    pre-alloc message to prefill, prefill's status message to decode) or, after a
    tag in ``tags`` (e.g. ``AUX_DATA``), in frame 1. Registration ("None"), other
    tags and anything unparsable name no room.
    """
    if not frames:
        return None
    room = _ascii_int(frames[0])
    if room is not None:
        return room
    if len(frames) > 1 and bytes(frames[0]) in set(tags):
        return _ascii_int(frames[1])
    return None


def prefill_unique_rank(attn_tp_rank: int, pp_rank: int, pp_size: int, attn_cp_rank: int, attn_cp_size: int) -> int:
    """The prefill rank id decode counts status replies by (SGLang's transfer worker formula).

    Needed where the release has no ``conclude_failure`` and the status sync to
    decode takes the rank explicitly (0.5.10.post1 - 0.5.12.post1).
    """
    return attn_tp_rank * (pp_size * attn_cp_size) + pp_rank * attn_cp_size + attn_cp_rank
