"""Pure pieces of F15: which messages on NIXL prefill's bootstrap socket stock's loop would die of.

No SGLang import. SGLang's NIXL prefill reads decode's messages on one ZMQ PULL socket in one
thread (``_start_bootstrap_thread``; 0.5.23 nixl/conn.py:3355-3426) with no per-message handler:
a first frame that is not ``GUARD`` fails an ``assert`` (:3379), fewer frames than it indexes an
``IndexError`` (:3384), a room frame that is neither ``"None"`` nor an integer a ``ValueError``
(:3392), a registration or request that its parser cannot read a ``struct.error`` or
``ValueError`` (``from_zmq``, :3388/:3395). Any of them ends the thread; every later decode
registration and request then waits in Bootstrapping (for ever up to 0.5.17, 300 s after).
:func:`screen` says, before stock's loop sees a message, whether it would raise there and why;
the adapter (``backends.nixl.bootstrap_screen``) hands it stock's own parsers.
"""

from __future__ import annotations

from typing import Callable, Collection, NamedTuple, Optional, Sequence

# Frames stock's loop reads from a request or registration: GUARD, room, endpoint, port, agent name.
MIN_FRAMES = 5


class Rejection(NamedTuple):
    """Why a message is not handed to stock's loop: ``kind`` is a short category (a metric
    label), ``detail`` the operator's text, ``room`` the request it names where it names one,
    ``sender`` the decode agent name where it parses."""

    kind: str
    detail: str
    room: Optional[int] = None
    sender: Optional[str] = None


def _ascii(frame) -> Optional[str]:
    try:
        return bytes(frame).decode("ascii")
    except (TypeError, UnicodeDecodeError):
        return None


def _int(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    try:
        return int(text)  # as stock's loop reads it
    except ValueError:
        return None


def screen(msg: Sequence, guard: bytes, passed_tags: Collection[bytes], handles_abort: bool,
           parse_registration: Callable, parse_request: Callable) -> Optional[Rejection]:
    """None if stock's bootstrap loop can handle ``msg``; else the :class:`Rejection`.

    ``passed_tags``: first frames stock's loop handles before its ``GUARD`` assert (staging's
    ``WATERMARK``/``STAGING_RSP``). ``handles_abort``: stock's loop takes decode's ``ABORT``
    before that assert (0.5.16+); it then needs an integer room in frame 1. Where it does not, an
    ``ABORT`` is traffic like any other that lacks the guard.
    ``parse_registration`` / ``parse_request``: stock's ``KVArgsRegisterInfo.from_zmq`` /
    ``TransferInfo.from_zmq``, called on ``msg[1:]`` as stock calls them (whatever they raise
    is the rejection)."""
    if not msg:
        return Rejection("empty", "an empty message")
    head = bytes(msg[0])
    if head in passed_tags:
        return None
    if head == b"ABORT" and handles_abort:
        room = _int(_ascii(msg[1])) if len(msg) > 1 else None
        if room is None:
            return Rejection("abort", f"an ABORT message of {len(msg)} frames with no integer room in frame 1")
        return None
    if head != guard:
        return Rejection("foreign", f"a {len(msg)}-frame message whose first frame is not SGLang's NIXL guard "
                                    f"{guard!r} (first bytes {head[:16]!r})")
    if len(msg) < MIN_FRAMES:
        return Rejection("short", f"a {len(msg)}-frame message; a registration or request has at least {MIN_FRAMES}")
    room_text, sender = _ascii(msg[1]), _ascii(msg[4])
    if sender is None:
        return Rejection("malformed", "a message whose agent-name frame (4) is not ASCII")
    if room_text == "None":
        try:
            parse_registration(list(msg[1:]))
        except Exception as exc:  # noqa: BLE001 - whatever stock's parser raises is the verdict
            return Rejection("registration", f"a registration that does not parse: {type(exc).__name__}: {exc}",
                             sender=sender)
        return None
    room = _int(room_text)
    if room is None:
        return Rejection("malformed", f"a message whose room frame (1) is neither \"None\" nor an integer "
                                      f"({bytes(msg[1])[:24]!r})", sender=sender)
    try:
        parse_request(list(msg[1:]))
    except Exception as exc:  # noqa: BLE001 - see above
        return Rejection("request", f"room {room}'s request that does not parse: {type(exc).__name__}: {exc}",
                         room=room, sender=sender)
    return None
