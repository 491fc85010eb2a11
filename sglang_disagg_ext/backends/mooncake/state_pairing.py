"""F7 for ``mooncake-ext``: paged state buffers paired by layer, never by a count-ratio guess.

Stock ``get_mha_kv_ptrs_with_pp`` (``disaggregation/common/conn.py``, 0.5.23
lines 1718-1748; the same function on 0.5.10.post1-0.5.12.post1) serves the
full KV pool and every paged state component on a non-MLA backend. When
decode registers more layers than prefill and the count is not a multiple,
it assumes decode appended a second model's K and V buffers after its own V
buffers: for a state pool with an MTP/nextn layer at the tail (one
``MHATokenToKVPool``: every K buffer, then every V buffer) prefill's V
buffers land in decode's draft K buffer and in the V buffer of the next
layer, and both sides report Success (upstream #27740).

The mixin changes that function only for calls that carry one of this
manager's state components (recognised by its registered pointer or
item-length list); the KV pool keeps stock's mapping. The pairing itself is
:mod:`sglang_disagg_ext.core.layer_pairing`. A component that cannot be paired
ends its request Failed on both sides through the ext manager's failure path
(the next ``send_aux`` returns -1), with a reason naming the component and
both counts; the manager and the peer session keep serving.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

from sglang_disagg_ext import metrics
from sglang_disagg_ext.core.layer_pairing import LayerPairingError, pair_state_layers

logger = logging.getLogger("sglang_disagg_ext.mooncake")


class StatePairingMixin:
    """Pairs paged state buffers by layer (F7). Composes in front of a ``MooncakeExtKVManager``."""

    def get_mha_kv_ptrs_with_pp(self, src_kv_ptrs: List[int], dst_kv_ptrs: List[int]):
        """Contract: prefill only, on a ``transfer_worker`` thread (or a thread of its
        executor pool), from ``_send_kvcache_generic`` (KV pages and, on a non-MLA
        backend, each paged state component) and from the SWA head-slice path
        (``_get_mha_head_slice_blocks``, called once with pointers and once with
        item lengths). ``src_kv_ptrs`` is this stage's registered list, the
        decode list comes from decode's registration, unchecked. Returns
        ``(src K, src V, dst K, dst V, layers)`` with entry ``i`` of each list
        paired. Must not touch the KV pool's mapping (stock decides it); must
        not return a pairing it cannot justify: raises ``LayerPairingError``,
        which ``maybe_send_extra`` turns into a Failed request.
        """
        where = self._state_component_of(src_kv_ptrs)
        if where is None:
            return super().get_mha_kv_ptrs_with_pp(src_kv_ptrs, dst_kv_ptrs)
        pairs = pair_state_layers(
            where, len(src_kv_ptrs), len(dst_kv_ptrs), pp_size=int(getattr(self, "pp_size", 1) or 1)
        )
        src_k, src_v, dst_k, dst_v = pairs.split(src_kv_ptrs, dst_kv_ptrs)
        return src_k, src_v, dst_k, dst_v, pairs.src_layers

    def maybe_send_extra(self, req, *args, **kwargs):
        """Contract: prefill only, on SGLang's ``transfer_worker`` thread, on a room's
        last chunk with state indices, once per non-dummy decode rank whose KV
        pages went out, before ``send_aux`` (signature differs by release; passed
        through). A pairing refusal raised below it is recorded for the room
        (``send_aux`` then returns -1, so the worker syncs Failed to decode) and
        0 is returned: a non-zero rc makes 0.5.23's worker mark the whole peer
        session failed, and an exception kills the transfer thread. Must not
        swallow anything but :class:`LayerPairingError`.
        """
        try:
            return super().maybe_send_extra(req, *args, **kwargs)
        except LayerPairingError as exc:
            metrics.count("requests_refused_total", fix="F7", reason="state layers cannot be paired")
            self._fail_state_send(req, f"state transfer refused: {exc}")
            return 0

    # -- which component a list belongs to ---------------------------------
    def _state_component_of(self, entries: Sequence[int]) -> Optional[str]:
        """``"state component i (kind)"`` if ``entries`` is one of this manager's state
        components' pointer (or item-length) lists, else None (the KV pool)."""
        entries = list(entries)
        for i, kind, ptrs, lens in self._state_components():
            if entries == ptrs or (entries == lens and len(lens) == len(ptrs)):
                return f"state component {i} ({kind})"
        return None

    def _state_components(self) -> List[Tuple[int, str, list, list]]:
        kv_args = self.kv_args
        ptrs = list(getattr(kv_args, "state_data_ptrs", None) or [])
        lens = list(getattr(kv_args, "state_item_lens", None) or [])
        types = getattr(kv_args, "state_types", None)
        if types is None:  # flat layout (0.5.10.post1, 0.5.11): one component
            if not ptrs:
                return []
            return [(0, _kind(getattr(kv_args, "state_type", "none")), ptrs, lens)]
        return [
            (i, _kind(t), list(ptrs[i] or []), list(lens[i] or []) if i < len(lens) else [])
            for i, t in enumerate(types)
            if i < len(ptrs)
        ]


def _kind(state_type) -> str:
    return str(getattr(state_type, "value", state_type))
