"""NIXL notification tags of a prefill rank (F4). No SGLang import.

Stock prefill code builds its NIXL notification tags inline, in a different
method per release (0.5.10.post1/0.5.11 ``add_transfer_request``, 0.5.12.x
``transfer_worker`` and ``_do_staging_transfer``), and puts a different
number in the sender field: the pipeline rank up to 0.5.11 (every TP rank of a
stage sends the same key: decode with fewer TP ranks than prefill never
completes), the TP rank from 0.5.12 (every stage sends the same key: decode
with fewer PP stages than prefill never completes). Stock decode reads that
field with ``int()`` and uses it only as a per-sender dict key.

``with_sender_id`` rewrites the sender field of every tag one prefill rank
emits to ``notification_sender_id(pp_rank, engine_rank)`` (see
``head_slice``), unique per (pipeline stage, TP rank), so one rewrite at the
point where tags leave the process fixes every release's builder at once.
Layouts (fields split on ``_``; the sender field index in brackets):

  kv        ``<room>_kv_<chunk>_<last>_[S]``
  stg       ``<room>_stg_<chunk>_<last>_[S]_<idx>_<start>_<n>_<agent>`` (0.5.12 staging)
  state     ``<room>_state_[S]`` (0.5.12: ``<room>_state_[S]_<component>``)
  aux_nokv  ``<room>_aux_nokv_[S]`` (0.5.11+)
  aux       ``<room>_aux`` (no sender; unchanged)

``failure_tag`` is the plugin's own kind, ``<room>_fail_<S>_<reason>``: stock
decode parsers of every supported release ignore a kind they do not know, an
ext decode marks the room Failed at once instead of waiting for its timeout.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Union

from sglang_disagg_ext.core.head_slice import notification_sender_id

# kind -> index of the sender field after splitting on "_".
SENDER_FIELD = {"kv": 4, "stg": 4, "state": 2}
_AUX_NOKV_FIELD = 3

FAIL_KIND = "fail"
MAX_REASON_CHARS = 300

Tag = Union[str, bytes, bytearray]


def _text(tag: Tag) -> str:
    if isinstance(tag, (bytes, bytearray)):
        return bytes(tag).decode("ascii")
    return str(tag)


def _like(original: Tag, text: str) -> Tag:
    return text.encode("ascii") if isinstance(original, (bytes, bytearray)) else text


def _room_ok(field: str) -> bool:
    return field.isascii() and field.isdigit()


def with_sender_id(tag: Tag, pp_rank: int, engine_rank: int) -> Tag:
    """``tag`` with its sender field set to this prefill rank's id; same type back.

    Tags without a sender field (``<room>_aux``), the plugin's own failure
    tags and anything not recognised are returned unchanged. A kv/state tag
    whose sender field is missing gets one appended (stock parsers read a
    missing field as 0, which is exactly the collision being fixed).
    """
    sender = str(notification_sender_id(pp_rank, engine_rank))
    try:
        text = _text(tag)
    except UnicodeDecodeError:
        return tag
    parts = text.split("_")
    if len(parts) < 2 or not _room_ok(parts[0]):
        return tag
    kind = parts[1]
    if kind == "aux":
        if len(parts) >= 3 and parts[2] == "nokv":
            idx = _AUX_NOKV_FIELD
        else:
            return tag
    elif kind in SENDER_FIELD:
        idx = SENDER_FIELD[kind]
    else:
        return tag
    if len(parts) > idx:
        parts[idx] = sender
    elif len(parts) == idx and kind in ("kv", "state"):
        parts.append(sender)
    else:
        return tag
    return _like(tag, "_".join(parts))


def _fields(tag: Tag, maxsplit: int, kind: str) -> Optional[List[str]]:
    """``tag`` split on "_" if it is ASCII, of ``kind`` (field 1) and names a room; else ``None``."""
    try:
        parts = _text(tag).split("_", maxsplit)
    except UnicodeDecodeError:
        return None
    if len(parts) < 2 or parts[1] != kind or not _room_ok(parts[0]):
        return None
    return parts


def aux_room(tag: Tag) -> Optional[int]:
    """The room of an aux notification (``<room>_aux`` or ``<room>_aux_nokv_<S>``), else ``None``."""
    parts = _fields(tag, 2, "aux")
    return None if parts is None else int(parts[0])


class FailureNotice(NamedTuple):
    room: int
    sender_id: int
    reason: str


def _clean_reason(reason: str) -> str:
    out = "".join(ch if (ch.isascii() and ch.isprintable()) else "?" for ch in str(reason))
    return out[:MAX_REASON_CHARS]


def failure_tag(room: int, pp_rank: int, engine_rank: int, reason: str) -> str:
    """``<room>_fail_<S>_<reason>``: prefill rank S gave up on ``room``."""
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"room must be a non-negative int, got {room!r}")
    sender = notification_sender_id(pp_rank, engine_rank)
    return f"{room}_{FAIL_KIND}_{sender}_{_clean_reason(reason)}"


def parse_failure_tag(tag: Tag) -> Optional[FailureNotice]:
    """The failure notice in ``tag``, or ``None`` if it is any other tag."""
    parts = _fields(tag, 3, FAIL_KIND)
    if parts is None or len(parts) < 3 or not _room_ok(parts[2]):
        return None
    return FailureNotice(int(parts[0]), int(parts[2]), parts[3] if len(parts) > 3 else "")
