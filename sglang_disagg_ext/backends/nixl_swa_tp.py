"""``nixl-ext`` on 0.5.13-0.5.21 (F13): stock ``NixlKVManager``, SWA state sent as head slices across TP sizes.

F4 (KV head slices, notification keys, memory kinds) is upstream from 0.5.13, so
this class changes one method on prefill. Stock ``maybe_send_extra`` raises
"PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid
models yet." for a non-MLA SWA component whenever prefill's and decode's
attention TP sizes differ (0.5.13 nixl/conn.py:1616-1618, 0.5.19 :2374-2376,
0.5.21 :2674-2676), per request, after the room's KV pages went out: prefill
ends the room Failed, and up to 0.5.19 decode is never told and waits out its
waiting timeout (300 s by default; 0.5.20 and 0.5.21 tell it through
``conclude_failure``). 0.5.22 added ``_send_swa_state_slice`` (upstream from
there). An SWA window cache is attention KV (``2 * layers`` buffers of pages,
K layers then V, the model's KV heads split over the attention TP ranks), so
F4's head layout (``core.head_slice``) places it exactly as KV:

* each SWA component that carries pages is posted by this class as one NIXL
  write of this prefill rank's heads into the decode rank's heads of the
  destination pages (``build_head_slice_descriptors``), with stock's
  per-component notification ``{notif}_{i}``, which stock decode counts per
  prefill rank (``received_state_per_pp``); a prefill rank that holds only a
  replica of the decode rank's heads sends that notification alone;
* SWA page lists of different lengths are aligned as Mooncake aligns them
  (``core.state_plan.align_state_indices``: the leading ``min(len)`` pages),
  where stock would raise "State index length mismatch";
* every other component goes to stock's ``maybe_send_extra`` unchanged (its
  SWA entries emptied, which stock skips).

A layout the head math cannot serve (heads that do not split over a TP size,
an SWA pool whose head bytes differ between the sides, different layer-buffer
counts) raises ``HeadLayoutError`` naming the component and the sizes; stock's
transfer worker then fails that room as it does for its own refusal.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import numpy as np
from sglang.srt.disaggregation.nixl.conn import NixlKVManager

from sglang_disagg_ext import activation_log
from sglang_disagg_ext.backends.shared import report_trim
from sglang_disagg_ext.core.head_slice import (
    HeadLayout,
    HeadLayoutError,
    build_head_slice_descriptors,
    head_bytes_from_item_len,
    resolve_total_kv_heads,
)
from sglang_disagg_ext.core.state_plan import ComponentPlan, Route, align_state_indices, state_kind_name

logger = logging.getLogger("sglang_disagg_ext.nixl")


class NixlSwaTpKVManager(NixlKVManager):
    """Stock 0.5.13-0.5.21 NIXL manager with F13; see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler thread
        at startup; nothing here is read before stock's constructor returns."""
        super().__init__(*args, **kwargs)
        activation_log.announce(type(self).__name__)

    def maybe_send_extra(self, peer_name, prefill_state_indices, dst_state_data_ptrs, dst_state_indices,
                         dst_gpu_id, notif, decode_tp_size, *args, **kwargs):
        """Stock's state send, with SWA components across TP sizes posted as head slices.

        Contract: prefill only, on a ``transfer_worker`` thread, for a room's last
        chunk carrying ``state_indices``, once per decode rank the room targets,
        after that rank's KV chunk was posted; ``peer_name`` is in
        ``decode_kv_args_table``. Returns a list of posted NIXL handles (stock's
        plus one per sliced SWA component; the worker drops None and waits for
        the rest), never waits for bytes. ``prefill_state_indices`` is shared by
        every decode rank of the room and ``dst_state_indices`` is decode's
        payload: neither is mutated. Keyword arguments after ``decode_tp_size``
        (``decode_tp_rank``, ``dst_state_item_lens``, ...) go to stock as given.
        """
        decode_tp_size = int(decode_tp_size)
        swa = self._f13_sliced_components(prefill_state_indices, decode_tp_size)
        if not swa:
            return super().maybe_send_extra(peer_name, prefill_state_indices, dst_state_data_ptrs,
                                            dst_state_indices, dst_gpu_id, notif, decode_tp_size, *args, **kwargs)
        rest = list(prefill_state_indices)
        for i in swa:
            rest[i] = []  # stock skips a component without pages
        handles = list(super().maybe_send_extra(peer_name, rest, dst_state_data_ptrs, dst_state_indices,
                                                dst_gpu_id, notif, decode_tp_size, *args, **kwargs) or [])
        info = self.decode_kv_args_table[peer_name]
        decode_tp_rank = int(kwargs.get("decode_tp_rank", args[0] if args else info.decode_tp_rank))
        dst_lens = kwargs.get("dst_state_item_lens", args[1] if len(args) > 1 else None)
        if dst_lens is None:
            dst_lens = getattr(info, "dst_state_item_lens", None) or []
        for i in swa:
            src_pages, dst_pages = prefill_state_indices[i], dst_state_indices[i] if i < len(dst_state_indices) else []
            if len(src_pages) != len(dst_pages):
                src_a, dst_a = align_state_indices(src_pages, dst_pages)
                report_trim(ComponentPlan(i, "swa", Route.PAGED, src_a, dst_a, len(src_pages), len(dst_pages)),
                            logger)
                src_pages, dst_pages = src_a, dst_a
            dst_item_lens = list(dst_lens[i]) if i < len(dst_lens) and dst_lens[i] else None
            handles.append(self._f13_post_swa_slice(
                peer_name, i, src_pages, dst_pages, list(dst_state_data_ptrs[i]),
                int(dst_item_lens[0]) if dst_item_lens else None, dst_gpu_id, f"{notif}_{i}",
                decode_tp_size, decode_tp_rank,
            ))
        return handles

    def _f13_sliced_components(self, prefill_state_indices, decode_tp_size: int) -> List[int]:
        """SWA components with pages, when the attention TP sizes differ on a non-MLA model."""
        if self.is_mla_backend or decode_tp_size == self.attn_tp_size or not prefill_state_indices:
            return []
        kinds = [state_kind_name(t) for t in (getattr(self.kv_args, "state_types", None) or [])]
        return [
            i for i, kind in enumerate(kinds)
            if kind == "swa" and i < len(prefill_state_indices)
            and prefill_state_indices[i] is not None and len(prefill_state_indices[i])
        ]

    def _f13_post_swa_slice(self, peer_name: str, i: int, src_pages, dst_pages, dst_ptrs: List[int],
                            dst_item_len: Optional[int], dst_gpu_id: int, notif: str, decode_tp_size: int,
                            decode_tp_rank: int):
        """Post this rank's heads of SWA component ``i``'s ``src_pages`` into ``dst_pages``.

        Returns the posted handle, or None after sending ``notif`` alone where this
        rank holds a replica of the decode rank's heads (another prefill rank sends
        them; decode still counts one state notification per prefill rank)."""
        what = f"SWA state (component {i})"
        prefill_tp = int(self.attn_tp_size)
        heads = resolve_total_kv_heads(
            getattr(self.kv_args, "total_kv_head_num", None), getattr(self.kv_args, "kv_head_num", 0) or 0, prefill_tp
        )
        try:
            layout = HeadLayout(prefill_tp, decode_tp_size, heads)
            head_slice = layout.head_slice(self.kv_args.engine_rank % prefill_tp, decode_tp_rank % decode_tp_size)
        except HeadLayoutError as exc:
            raise HeadLayoutError(
                f"nixl-ext: {what}: {heads} KV heads from prefill TP size {prefill_tp} to decode TP size "
                f"{decode_tp_size}: {exc}"
            ) from None
        if not head_slice.is_sender:
            self.agent.send_notif(peer_name, notif.encode("ascii"))
            return None
        src_ptrs = list(self.kv_args.state_data_ptrs[i])
        if len(src_ptrs) != len(dst_ptrs):
            raise HeadLayoutError(
                f"nixl-ext: {what}: prefill registers {len(src_ptrs)} layer buffers, decode {len(dst_ptrs)}; "
                "the layers cannot be paired"
            )
        page_size = int(self.kv_args.page_size)
        src_item_len = int(self.kv_args.state_item_lens[i][0])
        head_bytes = head_bytes_from_item_len(src_item_len, page_size, layout.prefill_heads_per_rank)
        if dst_item_len is None:
            dst_item_len = head_bytes * page_size * layout.decode_heads_per_rank
        dst_head_bytes = head_bytes_from_item_len(dst_item_len, page_size, layout.decode_heads_per_rank)
        if dst_head_bytes != head_bytes:
            raise HeadLayoutError(
                f"nixl-ext: {what}: pages of {src_item_len} bytes hold {layout.prefill_heads_per_rank} heads per "
                f"prefill rank ({head_bytes} bytes per head per token), pages of {dst_item_len} bytes "
                f"{layout.decode_heads_per_rank} per decode rank ({dst_head_bytes})"
            )
        rows = build_head_slice_descriptors(
            src_ptrs, dst_ptrs, src_pages, dst_pages, page_size=page_size, src_item_len=src_item_len,
            dst_item_len=dst_item_len, head_slice=head_slice, head_bytes=head_bytes,
        )
        # Stock's state transfers register and describe both sides as "VRAM" on these releases.
        src_reqs = np.column_stack([rows[:, 0], rows[:, 2], np.full(len(rows), self.kv_args.gpu_id, np.int64)])
        dst_reqs = np.column_stack([rows[:, 1], rows[:, 2], np.full(len(rows), dst_gpu_id, np.int64)])
        src_descs = self.agent.get_xfer_descs(src_reqs, "VRAM")
        dst_descs = self.agent.get_xfer_descs(dst_reqs, "VRAM")
        handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name, notif.encode("ascii"))
        if not handle:
            raise Exception(f"nixl-ext: failed to create the sliced {what} transfer")
        if self.agent.transfer(handle) == "ERR":
            raise Exception(f"nixl-ext: failed to post the sliced {what} transfer")
        return handle
