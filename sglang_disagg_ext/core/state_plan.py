"""Per-component plan for sending hybrid-model state (F1, F2). No SGLang import.

A hybrid model keeps, next to its full-attention KV pool, one or more *state
components*: a Mamba slot, SWA / NSA / DSv4 pages. On the last chunk prefill
sends, for each component, the state pages of the request to the pages decode
allocated. The two index lists can differ in length (prefill and decode size
their sliding windows independently), and stock SGLang either crashed on that
(0.5.10.post1: one-way, no-op slice) or dropped DSv4 state silently.

This module decides, per component, *what* to send; the backend adapter decides
*how*. Nothing here mutates its inputs: every index array in a plan is a fresh
copy, so the request that owns the lists is never changed.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional, Sequence

import numpy as np


class StateTransferError(ValueError):
    """A state component cannot be sent as asked (bad indices or layout)."""


class Route(str, enum.Enum):
    PAGED = "paged"  # contiguous-page path, pages addressed by index * item_len
    SINGLE_SLOT = "single-slot"  # one state slot per request (Mamba)
    SKIP = "skip"  # nothing to send for this component


# State types whose pages are addressed like KV pages. DSv4's pool (SWA +
# compressed + indexer) is one of these: upstream routed it through the same
# generic path as SWA/NSA (PR #24878, then #24888), which also handles MTP,
# where decode's indexer entry is larger and prefill writes its half in place.
PAGED_KINDS = frozenset({"swa", "nsa", "dsa", "dsv4"})
SINGLE_SLOT_KINDS = frozenset({"mamba"})
NO_STATE_KINDS = frozenset({"none", ""})
KNOWN_KINDS = PAGED_KINDS | SINGLE_SLOT_KINDS | NO_STATE_KINDS


def state_kind_name(state_type) -> str:
    """Normalise a state type (a str or a ``StateType`` enum member) to its name."""
    value = getattr(state_type, "value", state_type)
    if value is None:
        return "none"
    return str(value).lower()


@dataclasses.dataclass(frozen=True)
class ComponentPlan:
    component: int
    kind: str
    route: Route
    src: np.ndarray  # int32, fresh copy
    dst: np.ndarray  # int32, fresh copy, same length as src for PAGED
    src_len: int  # lengths as given, before alignment
    dst_len: int

    @property
    def trimmed(self) -> bool:
        return self.route is Route.PAGED and self.src_len != self.dst_len

    def describe_trim(self) -> str:
        kept = len(self.src)
        side = "prefill" if self.src_len > self.dst_len else "decode"
        return (
            f"state component {self.component} ({self.kind}): "
            f"len(prefill_state_indices)={self.src_len}, len(dst_state_indices)={self.dst_len}; "
            f"sending the first {kept} pages ({side} side trimmed)"
        )


def _as_index_array(values, component: int, kind: str, side: str) -> np.ndarray:
    if values is None:
        return np.zeros(0, dtype=np.int32)
    arr = np.array(values, dtype=np.int64).ravel()  # np.array copies
    if arr.size and arr.min() < 0:
        raise StateTransferError(
            f"state component {component} ({kind}): negative {side} state index "
            f"{int(arr.min())} in {side} indices of length {arr.size}"
        )
    if arr.size and arr.max() > np.iinfo(np.int32).max:
        raise StateTransferError(
            f"state component {component} ({kind}): {side} state index {int(arr.max())} "
            "does not fit in int32"
        )
    return arr.astype(np.int32)


def align_state_indices(src, dst):
    """Trim the longer of two page-index lists to the shorter one's length.

    Returns two new int32 arrays; the inputs are never modified. The leading
    pages are kept: both sides list a request's state pages in token order, so
    the first ``min(len)`` entries name the same logical pages.
    """
    src_arr = np.array(src if src is not None else [], dtype=np.int32).ravel()
    dst_arr = np.array(dst if dst is not None else [], dtype=np.int32).ravel()
    n = min(src_arr.size, dst_arr.size)
    return src_arr[:n].copy(), dst_arr[:n].copy()


def _entry(seq: Optional[Sequence], i: int):
    if seq is None or i >= len(seq):
        return None
    return seq[i]


def plan_state_transfer(
    state_kinds: Sequence,
    prefill_indices: Optional[Sequence],
    dst_indices: Optional[Sequence],
) -> List[ComponentPlan]:
    """Plan every state component of one request.

    ``state_kinds[i]`` is component *i*'s type; ``prefill_indices[i]`` and
    ``dst_indices[i]`` its page (or slot) indices on each side. A component
    missing from ``prefill_indices`` (shorter list or ``None`` entry) has
    nothing to send and is skipped; a missing destination entry counts as empty.

    Raises ``StateTransferError`` naming the component and lengths when a
    component cannot be sent (unknown type, Mamba without exactly one slot on
    each side, negative index).
    """
    plans: List[ComponentPlan] = []
    for i, raw_kind in enumerate(state_kinds):
        kind = state_kind_name(raw_kind)
        if kind not in KNOWN_KINDS:
            raise StateTransferError(
                f"state component {i}: unknown state type {kind!r} "
                f"(known: {', '.join(sorted(KNOWN_KINDS - NO_STATE_KINDS))})"
            )
        src_raw = _entry(prefill_indices, i)
        dst_raw = _entry(dst_indices, i)
        src = _as_index_array(src_raw, i, kind, "prefill")
        dst = _as_index_array(dst_raw, i, kind, "decode")
        empty = np.zeros(0, dtype=np.int32)
        if kind in NO_STATE_KINDS or src_raw is None:
            plans.append(ComponentPlan(i, kind, Route.SKIP, empty, empty, src.size, dst.size))
            continue
        if kind in SINGLE_SLOT_KINDS:
            if src.size != 1 or dst.size != 1:
                raise StateTransferError(
                    f"state component {i} ({kind}): a Mamba state needs exactly one slot per side, "
                    f"got len(prefill_state_indices)={src.size}, len(dst_state_indices)={dst.size}"
                )
            plans.append(ComponentPlan(i, kind, Route.SINGLE_SLOT, src, dst, 1, 1))
            continue
        n = min(src.size, dst.size)
        route = Route.PAGED if n > 0 else Route.SKIP
        plans.append(
            ComponentPlan(i, kind, route, src[:n].copy(), dst[:n].copy(), src.size, dst.size)
        )
    return plans


def check_paged_item_lens(
    component: int, kind: str, src_item_lens: Sequence[int], dst_item_lens: Sequence[int]
) -> None:
    """Refuse a paged send whose per-buffer entry sizes differ between sides.

    The generic page path addresses decode pages with prefill's entry size;
    with a different decode entry size every page after the first would land
    at the wrong offset. Only checked when both sides list the same number of
    buffers: with pipeline stages or MTP decode registers more buffers than one
    prefill stage sends, and the pairing is the engine adapter's business.
    DSv4 is exempt: with MTP its decode indexer entry is larger than prefill's
    and upstream's generic path deliberately writes prefill's part in place.
    """
    if kind == "dsv4" or not dst_item_lens or len(src_item_lens) != len(dst_item_lens):
        return
    for layer, (s, d) in enumerate(zip(src_item_lens, dst_item_lens)):
        if int(s) != int(d):
            raise StateTransferError(
                f"state component {component} ({kind}): buffer {layer} entry size differs, "
                f"prefill {int(s)} bytes vs decode {int(d)} bytes "
                f"({len(src_item_lens)} buffers per side)"
            )
