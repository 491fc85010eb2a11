"""``nixl-ext`` on 0.5.13-0.5.21 (F13): stock ``NixlKVManager``, SWA state (and up to 0.5.16 replicated KV
heads) sent as head slices across TP sizes.

F4 (KV head slices, notification keys, memory kinds) is upstream from 0.5.13 (but
see below for 0.5.13-0.5.16), so this class changes prefill's state send. Stock ``maybe_send_extra`` raises
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

Up to 0.5.16 one more piece of F4 is missing upstream: stock's prepared head-slice lists
(``_init_hetero_tp_prep_handle``) have one head group per decode rank and pick a decode
rank's heads by modulo, so a decode whose TP size exceeds the model's KV heads (it
replicates them) makes ``prep_xfer_dlist`` raise ``NIXL_ERR_NOT_FOUND`` on prefill's
bootstrap thread, which dies. For such a peer (and only there, only where
``releases.features().stock_nixl_prep_serves_decode_replicas`` is False) nothing is
prepared and ``send_kvcache_slice`` posts this rank's KV heads per chunk with the same
head math.

A layout the head math cannot serve (heads that do not split over a TP size,
an SWA pool whose head bytes differ between the sides, different layer-buffer
counts) is refused at registration, before any request to that decode rank
is accepted (:meth:`.registration.RegistrationRefusalMixin._check_pair`,
shared with F11), with one error naming the component, both TP sizes and the
sizes that differ; stock instead fails each request at transfer time, after
its KV pages went out. The per-chunk path still raises ``HeadLayoutError``
(the transfer worker then fails the room) should a layout reach it anyway.

Prefill's bootstrap thread survives a registration that raises
(:class:`.registration.RegistrationRefusalMixin`, shared with F11's class):
stock's thread (0.5.13 nixl/conn.py:1821-1880) has no handler, so one exception
while registering one decode rank ends it, and every later room of every decode
waits out SGLang's timeouts. Here that decode rank is refused with the exception
as the reason, its rooms end Failed on prefill at once (decode is told from
0.5.20, through ``conclude_failure``; up to 0.5.19 no NIXL message can tell it,
and it ends them by its waiting timeout), and every other decode is still served.
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, List, Optional

from sglang.srt.disaggregation.nixl.conn import NixlKVManager

from sglang_disagg_ext import activation_log, releases
from sglang_disagg_ext.backends.nixl.bootstrap_screen import BootstrapScreenMixin
from sglang_disagg_ext.backends.nixl.registration import RegistrationRefusalMixin
from sglang_disagg_ext.backends.common.shared import report_trim
from sglang_disagg_ext.core.head_slice import (
    HeadLayout,
    HeadLayoutError,
    head_layout_for,
    head_slice_rows,
    resolve_total_kv_heads,
    transfer_requests,
)
from sglang_disagg_ext.core.state_plan import ComponentPlan, Route, align_state_indices, state_kind_name

logger = logging.getLogger("sglang_disagg_ext.nixl")


class NixlSwaTpKVManager(RegistrationRefusalMixin, BootstrapScreenMixin, NixlKVManager):
    """Stock 0.5.13-0.5.21 NIXL manager with F13; see the module docstring."""

    refusal_fix = "F13"

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler thread
        at startup. Stock's constructor starts prefill's bootstrap thread, which may call
        ``_init_hetero_tp_prep_handle``: the layout cache exists before ``super().__init__``."""
        # decode TP size -> HeadLayout: built once per decode size, not per chunk on the transfer path.
        self._f13_layouts: Dict[int, HeadLayout] = {}
        super().__init__(*args, **kwargs)
        activation_log.announce(self)

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
            handles.append(self._f13_post_head_slice(
                peer_name, f"SWA state (component {i})", list(self.kv_args.state_data_ptrs[i]), list(dst_state_data_ptrs[i]),
                int(self.kv_args.state_item_lens[i][0]), int(dst_item_lens[0]) if dst_item_lens else None,
                src_pages, dst_pages, dst_gpu_id, f"{notif}_{i}", decode_tp_size, decode_tp_rank,
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

    # -- KV across TP sizes where stock's prepared slice lists are wrong (0.5.13-0.5.16) ---------------
    def _init_hetero_tp_prep_handle(self, peer_name, decode_kv_args, *args, **kwargs):
        """Stock's prepared head-slice lists for a decode of another TP size, unless stock gets them wrong.

        Contract: prefill only, on the bootstrap thread, from stock ``_prepare_payload_xfer``
        while a decode rank of another attention TP size registers (non-MLA); must leave
        what ``send_kvcache_slice`` reads for that peer. Up to 0.5.16 stock lays out one
        head group per decode rank and picks a decode rank's heads by modulo (0.5.16
        nixl/conn.py:771-776), so a decode that replicates KV heads (decode TP size above
        the model's KV heads) addresses past the registered KV region:
        ``prep_xfer_dlist`` raises ``NIXL_ERR_NOT_FOUND`` on the bootstrap thread, which
        dies, and every later room waits out SGLang's timeouts. For such a peer nothing
        is prepared here; :meth:`send_kvcache_slice` slices each chunk itself.
        """
        if self._f4_stock_prep_serves(decode_kv_args):
            return super()._init_hetero_tp_prep_handle(peer_name, decode_kv_args, *args, **kwargs)
        logger.info("nixl-ext: decode %s (TP size %s) replicates KV heads: its KV head slices are built per "
                    "chunk (stock's prepared lists cannot serve it on this release)", peer_name,
                    decode_kv_args.decode_tp_size)
        return None

    def send_kvcache_slice(self, peer_name, prefill_kv_indices, dst_kv_indices, notif, *args, **kwargs):
        """Stock's prepared slice transfer, or this rank's KV heads posted directly (see above).

        Contract: prefill only, on a ``transfer_worker`` thread, per KV chunk to a decode
        rank of another attention TP size (non-MLA); ``dst_kv_indices`` is the chunk's
        slice of decode's pages. Returns a posted handle (or None after a
        notification-only message from a replica rank); never waits for the bytes.
        """
        info = self.decode_kv_args_table[peer_name]
        if self._f4_stock_prep_serves(info):
            return super().send_kvcache_slice(peer_name, prefill_kv_indices, dst_kv_indices, notif, *args, **kwargs)
        return self._f13_post_head_slice(
            peer_name, "KV", list(self.kv_args.kv_data_ptrs), list(info.dst_kv_ptrs), int(self.kv_args.kv_item_lens[0]),
            int(info.dst_kv_item_len), prefill_kv_indices, dst_kv_indices, info.gpu_id, notif,
            int(info.decode_tp_size), int(info.decode_tp_rank),
        )

    def _f4_stock_prep_serves(self, decode_kv_args) -> bool:
        """Whether stock's prepared head-slice lists are right for this decode: always from 0.5.17
        (``releases.features().stock_nixl_prep_serves_decode_replicas``), else only while the
        decode holds distinct heads (its TP size at most the model's KV heads)."""
        if releases.features().stock_nixl_prep_serves_decode_replicas:
            return True
        return int(decode_kv_args.decode_tp_size) <= self._f13_total_kv_heads

    @functools.cached_property
    def _f13_total_kv_heads(self) -> int:
        """The model's KV heads (``kv_args`` is fixed once the manager is built)."""
        return resolve_total_kv_heads(
            getattr(self.kv_args, "total_kv_head_num", None), getattr(self.kv_args, "kv_head_num", 0) or 0,
            int(self.attn_tp_size),
        )

    def _f13_layout(self, what: str, decode_tp_size: int) -> HeadLayout:
        layout = self._f13_layouts.get(decode_tp_size)
        if layout is None:
            layout = head_layout_for(int(self.attn_tp_size), decode_tp_size, self._f13_total_kv_heads,
                                     f"nixl-ext: {what}")
            self._f13_layouts[decode_tp_size] = layout
        return layout

    # -- posting one head slice ---------------------------------------------------------------------
    def _f13_post_head_slice(self, peer_name: str, what: str, src_ptrs: List[int], dst_ptrs: List[int], src_item_len: int,
                             dst_item_len: Optional[int], src_pages, dst_pages, dst_gpu_id: int, notif: str,
                             decode_tp_size: int, decode_tp_rank: int):
        """Post this rank's heads of ``src_pages`` into ``dst_pages`` of a paged K/V buffer list
        (K layers then V, the same count on both sides).

        Returns the posted handle, or None after sending ``notif`` alone where this rank
        holds a replica of the decode rank's heads or has no pages (another prefill rank
        sends them; decode still counts one notification per prefill rank)."""
        layout = self._f13_layout(what, decode_tp_size)
        try:
            head_slice = layout.head_slice(self.kv_args.engine_rank % layout.prefill_tp_size,
                                           decode_tp_rank % decode_tp_size)
        except HeadLayoutError as exc:
            raise HeadLayoutError(f"nixl-ext: {what}: {exc}") from None
        if not head_slice.is_sender or not len(src_pages):
            self.agent.send_notif(peer_name, notif.encode("ascii"))
            return None
        if len(src_ptrs) != len(dst_ptrs):
            raise HeadLayoutError(
                f"nixl-ext: {what}: prefill registers {len(src_ptrs)} layer buffers, decode {len(dst_ptrs)}; "
                "the layers cannot be paired"
            )
        rows = head_slice_rows(
            layout, head_slice, what, src_ptrs, dst_ptrs, src_pages, dst_pages,
            page_size=int(self.kv_args.page_size), src_item_len=src_item_len, dst_item_len=dst_item_len,
        )
        # Stock's state and slice transfers describe both sides as "VRAM" on these releases.
        src_reqs, dst_reqs = transfer_requests(rows, self.kv_args.gpu_id, dst_gpu_id)
        src_descs = self.agent.get_xfer_descs(src_reqs, "VRAM")
        dst_descs = self.agent.get_xfer_descs(dst_reqs, "VRAM")
        handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name, notif.encode("ascii"))
        if not handle:
            raise Exception(f"nixl-ext: failed to create the sliced {what} transfer")
        if self.agent.transfer(handle) == "ERR":
            raise Exception(f"nixl-ext: failed to post the sliced {what} transfer")
        return handle
