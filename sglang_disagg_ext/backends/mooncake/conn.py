"""``mooncake-ext``: SGLang's Mooncake manager with the plugin's fixes, composed per release.

:func:`manager_class` builds the class from the release's live fixes: one mixin
per fix (F6 ``isolation``, F7 ``state_pairing``, F8
``threads``, F9 ``registration``, F17 ``dropped_rooms``, F18
``compatibility``), each cooperative, in front
of the state class below where F1 or F2 is live, else in front of
:class:`MooncakeExtKVManager` (stock's state path, the activation line and the
failure plumbing the mixins share).

What the state classes change against stock ``MooncakeKVManager``:

* Each state component's prefill and decode page lists are aligned by trimming
  the longer one on local copies (F1); the request's own lists are never
  touched, so a retry or another destination rank sees what decode sent.
* SWA, NSA and DSv4 components go through the generic page path (F2: stock
  flat-layout code returns 0 for ``dsv4`` and decode reads stale pages).
  Mamba components go to SGLang's own Mamba path, unchanged.
* A failure in the state path ends the request as Failed on both sides: stock
  ignores ``maybe_send_extra``'s result (or, on 0.5.10.post1, lets the
  exception kill the transfer thread, leaving decode to time out). Here the
  failure is recorded and the following ``send_aux`` for that request reports
  failure, so the stock worker syncs Failed to every decode rank and the
  manager keeps serving the next request.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Sequence

from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

from sglang_disagg_ext import activation_log, releases, verification
from sglang_disagg_ext.backends.mooncake.compatibility import PeerCompatibilityMixin
from sglang_disagg_ext.backends.mooncake.dropped_rooms import MooncakeDroppedRoomsMixin
from sglang_disagg_ext.backends.mooncake.isolation import RequestIsolationMixin
from sglang_disagg_ext.backends.mooncake.peers import MooncakeExtKVReceiver
from sglang_disagg_ext.backends.mooncake.registration import RegistrationCheckMixin
from sglang_disagg_ext.backends.mooncake.state_pairing import StatePairingMixin
from sglang_disagg_ext.backends.mooncake.threads import ThreadSurvivalMixin
from sglang_disagg_ext.backends.mooncake.verify import MooncakeVerifiedTransferMixin
from sglang_disagg_ext.backends.common.shared import report_trim
from sglang_disagg_ext.core.state_plan import (
    ComponentPlan,
    Route,
    StateTransferError,
    check_paged_item_lens,
    plan_state_transfer,
)
from sglang_disagg_ext.releases import ReleasePolicy, StateLayout

logger = logging.getLogger("sglang_disagg_ext.mooncake")


class MooncakeExtKVManager(MooncakeKVManager):
    """Parts shared by both state layouts; see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup (``PrefillBootstrapQueue`` / ``DecodePreallocQueue``
        ``._init_kv_manager``, via ``get_kv_class``), with SGLang's own arguments.
        On prefill the stock constructor starts the ``transfer_worker`` threads,
        so everything they read must exist before ``super().__init__``.
        """
        # Set before super().__init__: the stock constructor starts the
        # transfer threads, which may call send_aux.
        self._failed_state_sends = set()
        self._failed_state_lock = threading.Lock()
        super().__init__(*args, **kwargs)
        activation_log.announce(self)

    # -- failure plumbing -------------------------------------------------
    def _fail_state_send(self, req, reason: str) -> None:
        logger.error("room %s: %s", req.room, reason)
        self.record_failure(req.room, reason)
        with self._failed_state_lock:
            self._failed_state_sends.add((req.room, req.mooncake_session_id))

    def send_aux(self, req, *args, **kwargs):
        """Stock ``send_aux``, but ``-1`` for a request whose state send failed.

        Contract: prefill only. SGLang's ``transfer_worker`` thread calls it on a
        room's last chunk, once per non-dummy decode rank, after that rank's KV
        pages went out with rc 0 and after ``maybe_send_extra``; no manager lock
        is held. Its rc is that rank's poll: only when every
        ``required_dst_info_num`` rank returned 0 does the worker set Success and
        sync it to decode. Never return 0 for a request whose state failed, and
        never raise: the worker re-raises and its transfer thread dies.
        """
        with self._failed_state_lock:
            failed = (req.room, req.mooncake_session_id) in self._failed_state_sends
            self._failed_state_sends.discard((req.room, req.mooncake_session_id))
        if failed:
            # Non-zero makes the stock worker mark the request Failed and sync
            # that to decode, instead of Success with missing state.
            return -1
        return super().send_aux(req, *args, **kwargs)

    def _send_state_guarded(self, req, send) -> int:
        try:
            rc = send()
        except Exception as exc:  # noqa: BLE001 - any failure must end the request, not the thread
            self._fail_state_send(req, f"state transfer failed: {exc}")
            return -1
        if rc != 0:
            self._fail_state_send(req, f"state transfer failed: engine returned {rc}")
        return rc

    # -- one paged component ---------------------------------------------
    def _send_paged_component(
        self,
        req,
        plan: ComponentPlan,
        src_data_ptrs: Sequence[int],
        src_item_lens: Sequence[int],
        dst_data_ptrs: Sequence[int],
        dst_item_lens: Sequence[int],
        target_rank_registration_info,
        executor,
    ) -> int:
        info = target_rank_registration_info
        if (
            info is not None
            and not self.is_mla_backend
            and self.attn_tp_size != info.dst_attn_tp_size
        ):
            raise StateTransferError(
                f"state component {plan.component} ({plan.kind}): different attention TP sizes "
                f"(prefill {self.attn_tp_size}, decode {info.dst_attn_tp_size}) are not supported "
                "for non-MLA paged state"
            )
        if not dst_data_ptrs:
            raise StateTransferError(
                f"state component {plan.component} ({plan.kind}): decode registered no buffers "
                f"for it, prefill has {len(src_data_ptrs)}"
            )
        check_paged_item_lens(plan.component, plan.kind, src_item_lens, dst_item_lens)
        if plan.trimmed:
            report_trim(plan, logger)
        return self._send_kvcache_generic(
            mooncake_session_id=req.mooncake_session_id,
            src_data_ptrs=list(src_data_ptrs),
            dst_data_ptrs=list(dst_data_ptrs),
            item_lens=list(src_item_lens),
            prefill_data_indices=plan.src,
            dst_data_indices=plan.dst,
            executor=executor,
        )


class MooncakeExtKVManagerFlat(MooncakeExtKVManager):
    """0.5.10.post1 / 0.5.11: one state component, ``kv_args.state_type: str``."""

    def maybe_send_extra(
        self,
        req,
        prefill_state_indices,
        dst_state_data_ptrs,
        executor,
        target_rank_registration_info=None,
    ):
        """Contract: prefill only, on SGLang's ``transfer_worker`` thread: a room's
        last chunk carrying ``state_indices`` (built by the scheduler's
        ``send_kv_chunk``), once per non-dummy decode rank whose KV pages went
        out with rc 0, before ``send_aux``. ``prefill_state_indices`` is shared
        by all those ranks; ``req.dst_state_indices`` is decode's
        ``send_metadata`` payload; SGLang never compares their lengths. Stock
        ignores the rc and re-raises exceptions (the thread dies): so never
        raise, never mutate either list, write only into ``req.dst_state_indices``'
        pages, and report failure through the following ``send_aux``.
        """
        def send() -> int:
            kind = getattr(self.kv_args, "state_type", "none")
            (plan,) = plan_state_transfer([kind], [prefill_state_indices], [req.dst_state_indices])
            if plan.route is Route.SINGLE_SLOT:
                return MooncakeKVManager.maybe_send_extra(
                    self,
                    req,
                    prefill_state_indices,
                    dst_state_data_ptrs,
                    executor,
                    target_rank_registration_info,
                )
            if plan.route is Route.SKIP:
                return 0
            info = target_rank_registration_info
            return self._send_paged_component(
                req,
                plan,
                self.kv_args.state_data_ptrs,
                self.kv_args.state_item_lens,
                dst_state_data_ptrs,
                getattr(info, "dst_state_item_lens", None) or [],
                info,
                executor,
            )

        return self._send_state_guarded(req, send)


class MooncakeExtKVManagerPerComponent(MooncakeExtKVManager):
    """0.5.12 / 0.5.12.post1: ``kv_args.state_types`` list, list-of-lists buffers."""

    def maybe_send_extra(
        self,
        req,
        prefill_state_indices: List,
        executor,
        target_rank_registration_info=None,
    ):
        """Contract: as the flat layout's (``transfer_worker`` thread, prefill, last
        chunk, once per non-dummy decode rank, before ``send_aux``), called when
        ``state_indices`` is non-empty. ``prefill_state_indices`` has one entry
        per ``kv_args.state_types`` component (``None`` = nothing to send) and
        is shared by all decode ranks; ``req.dst_state_indices`` and the decode
        pointers in ``target_rank_registration_info`` come from decode,
        unchecked. Same rules: never raise, never mutate the index lists, fail
        through ``send_aux``.
        """
        def send() -> int:
            state_types = list(getattr(self.kv_args, "state_types", []) or [])
            plans = plan_state_transfer(state_types, prefill_state_indices, req.dst_state_indices)
            info = target_rank_registration_info
            rc = 0
            for plan in plans:
                i = plan.component
                if plan.route is Route.SKIP:
                    continue
                if plan.route is Route.SINGLE_SLOT:
                    # SGLang's own Mamba path (including its TP-slice variant),
                    # given only this component's indices.
                    only_this = [None] * len(state_types)
                    only_this[i] = prefill_state_indices[i]
                    rc = MooncakeKVManager.maybe_send_extra(self, req, only_this, executor, info) or rc
                    continue
                rc = (
                    self._send_paged_component(
                        req,
                        plan,
                        self.kv_args.state_data_ptrs[i],
                        self.kv_args.state_item_lens[i],
                        _component(getattr(info, "dst_state_data_ptrs", None), i),
                        _component(getattr(info, "dst_state_item_lens", None), i),
                        info,
                        executor,
                    )
                    or rc
                )
            return rc

        return self._send_state_guarded(req, send)


def _component(per_component: Optional[Sequence], i: int) -> list:
    if not per_component or i >= len(per_component) or per_component[i] is None:
        return []
    return list(per_component[i])


# The per-fix mixins, in MRO order (first = outermost). Each is a plain class
# whose overrides call ``super()``, so any subset composes over the state class.
_FIX_MIXINS = (
    ("F6", RequestIsolationMixin),
    ("F7", StatePairingMixin),
    ("F8", ThreadSurvivalMixin),
    ("F9", RegistrationCheckMixin),
    ("F17", MooncakeDroppedRoomsMixin),
    ("F18", PeerCompatibilityMixin),
)


def manager_class(policy: ReleasePolicy) -> Optional[type]:
    """The ``-ext`` Mooncake manager for ``policy``'s release, or ``None`` (pass-through).

    The state class carries F1/F2 where either is live (it replaces
    ``maybe_send_extra``); elsewhere :class:`MooncakeExtKVManager` keeps stock's
    state path. The live fixes' mixins go in front of it.
    """
    mixins = tuple(mixin for fix, mixin in _FIX_MIXINS if policy.is_live(fix))
    fixes = "".join(fix for fix, mixin in _FIX_MIXINS if mixin in mixins)
    # Verified transfers (opt-in): outermost, so its digest sees every engine write the
    # fixes let through, and its decode check runs before any Success.
    if verification.enabled():
        why = verification.available(policy)["mooncake-ext"]
        if not why:
            mixins = (MooncakeVerifiedTransferMixin,) + mixins
            fixes = "V" + fixes
        else:
            logger.warning("%s=1: %s; mooncake-ext transfers are not verified", verification.VERIFY_ENV, why)
    if policy.is_live("F1") or policy.is_live("F2"):
        state_class = MooncakeExtKVManagerFlat if policy.layout is StateLayout.FLAT else MooncakeExtKVManagerPerComponent
    elif mixins or policy.routes("mooncake"):
        # routes() without a live fix: patched sources carrying every live Mooncake fix
        # (patches/0.5.23: F6-F9). The -ext name still runs the plugin's manager, which
        # then adds nothing to the patched stock code.
        state_class = MooncakeExtKVManager
    else:
        return None
    if not mixins:
        return state_class
    return type(
        f"{state_class.__name__}_{fixes}",
        mixins + (state_class,),
        {"__module__": __name__, "__doc__": f"{state_class.__doc__} With {', '.join(m.__name__ for m in mixins)}."},
    )


def ext_classes(policy: ReleasePolicy) -> Dict[str, type]:
    """Names in ``sglang.srt.disaggregation.mooncake`` to route to the plugin."""
    cls = manager_class(policy) if policy.routes("mooncake") else None
    if cls is None:
        return {}
    classes = {"MooncakeKVManager": cls}
    # F6/F9 before 0.5.23: the receiver builds decode's registration itself, so the
    # pool-sizes frame is added there (peers).
    if (policy.is_live("F6") or policy.is_live("F9")) and not releases.features().mooncake_registration_hooks:
        classes["MooncakeKVReceiver"] = MooncakeExtKVReceiver
    return classes
