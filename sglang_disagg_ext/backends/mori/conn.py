"""``mori-ext``: SGLang 0.5.12.x's MoRI backend with per-component hybrid state (F3).

SGLang 0.5.12 made hybrid state per component (``kv_args.state_types`` is a
list; state pointers, item lengths and dims are lists of lists) and moved
Mooncake and NIXL over, but MoRI only halfway (0.5.12.post1 ``mori/conn.py``):

* the decode receiver ``struct.pack("I", item_len)``-s the per-component item
  lengths (:1423): ``struct.error: required argument is not an integer`` at PD
  bootstrap of every hybrid model (issue #26525);
* state indices (:101, :1468), memory descriptors (:365, :1418) and dims travel
  as one flat list, and ``send_state`` (:921) reads a ``state_type`` string that
  0.5.12 no longer sets.

What this module changes, as thin subclasses over the stock classes:

* Wire: the state fields of the registration and transfer messages are the
  versioned per-component payloads of :mod:`sglang_disagg_ext.core.state_wire`
  (index list per component, ``None`` for a missing component; item lengths and
  dims per component; descriptor list per component). Everything else in the
  messages is byte-for-byte SGLang's.
* Registration: local state buffers are registered per component (a zero-length
  tensor keeps its slot as ``None`` instead of being handed to ``ibv_reg_mr``);
  decode's buffers are kept per component.
* Dispatch: ``send_state`` plans each component with
  :func:`~sglang_disagg_ext.core.state_plan.plan_state_transfer`; Mamba goes to
  the single-slot path, SWA/NSA/DSA/DSv4 to the contiguous-page path, with
  byte ranges from :mod:`sglang_disagg_ext.core.state_blocks`. A component that
  cannot be sent raises, and SGLang's ``add_transfer_request`` turns that into
  ``Failed`` on both sides.
* Peers that do not speak this wire are refused at registration, not deep in
  a transfer: prefill refuses a decode whose registration carries the old
  flat (or another) state format, logs why, and fails each of that decode's
  requests with the reason (decode receives it with the Failed status). Decode
  asks the prefill's bootstrap server (``WIRE_ROUTE``, served only by this
  plugin's bootstrap server) before registering, and fails the request with a
  clear reason when the prefill runs stock ``mori``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

try:
    from sglang.srt.disaggregation.mori import conn as _conn
except ModuleNotFoundError as _exc:  # pragma: no cover - depends on the machine
    if (_exc.name or "").split(".")[0] == "mori":
        raise ImportError(
            "mori-ext needs AMD's MoRI package (`mori`, ROCm only, not on PyPI), which SGLang's "
            "MoRI backend imports; install it on the AMD node (see docs/mori.md)"
        ) from _exc
    raise

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_disagg_ext import activation_log
from sglang_disagg_ext.backends.mori.aux_rows import AuxRowCheckMixin
from sglang_disagg_ext.backends.mori.transfer_info import TransferInfoFailureMixin
from sglang_disagg_ext.backends.common.shared import probe_prefill_version
from sglang_disagg_ext.core.aux_rows import encode_aux_item_lens
from sglang_disagg_ext.core.state_blocks import mamba_slot_block, paged_byte_blocks
from sglang_disagg_ext.core.state_plan import (
    ComponentPlan,
    Route,
    StateTransferError,
    check_paged_item_lens,
    plan_state_transfer,
    state_kind_name,
)
from sglang_disagg_ext.core.state_wire import (
    WIRE_VERSION,
    StateWireError,
    decode_ints_per_component,
    decode_mem_descs_per_component,
    decode_state_indices,
    encode_ints_per_component,
    encode_mem_descs_per_component,
    encode_state_indices,
)
from sglang_disagg_ext.releases import ReleasePolicy

logger = logging.getLogger("sglang_disagg_ext.mori")

MoriKVManager = _conn.MoriKVManager
MoriKVSender = _conn.MoriKVSender
MoriKVReceiver = _conn.MoriKVReceiver
MoriKVBootstrapServer = _conn.MoriKVBootstrapServer
MORI_GUARD = _conn.MORI_GUARD
EngineDesc = _conn.EngineDesc
MemoryDesc = _conn.MemoryDesc
MemoryLocationType = _conn.MemoryLocationType

# Served by MoriExtKVBootstrapServer only: decode asks it whether the prefill
# speaks this plugin's state wire before registering.
WIRE_ROUTE = "/sglang_disagg_ext/mori_state_wire"
WIRE_PROBE_TIMEOUT_S = 5.0


class PeerRefused(ValueError):
    """A peer whose registration this side cannot work with."""


def normalize_state_indices(state_indices) -> Optional[List[Optional[np.ndarray]]]:
    """SGLang's per-component ``state_indices`` -> int32 arrays, ``None`` kept per component."""
    if state_indices is None:
        return None
    return [None if entry is None else np.asarray(entry, dtype=np.int32).ravel() for entry in state_indices]


def _component(per_component: Optional[Sequence], i: int) -> list:
    if not per_component or i >= len(per_component) or per_component[i] is None:
        return []
    return list(per_component[i])


def _unpack_desc(blob: Optional[bytes], component: int, index: int):
    if blob is None:
        return None
    try:
        return MemoryDesc.unpack(blob)
    except Exception as exc:  # noqa: BLE001 - MoRI raises whatever msgpack/C++ raises
        raise StateWireError(f"state component {component} descriptor {index}: not a MemoryDesc ({exc})") from None


# -- wire types ---------------------------------------------------------------------------


@dataclasses.dataclass
class MoriExtTransferInfo(_conn.TransferInfo):
    """Decode's per-request message. ``dst_state_indices``: ``None`` (no state) or
    one int32 array per component, ``None`` where decode has nothing for it.
    ``wire_error``: set instead of raising when the state field is not this wire."""

    wire_error: Optional[str] = None

    @classmethod
    def from_zmq(cls, payload: List[bytes]) -> "MoriExtTransferInfo":
        room = int(payload[0].decode("ascii"))
        dst_kv_indices = (
            np.frombuffer(payload[4], dtype=np.int32) if payload[4] else np.array([], dtype=np.int32)
        )
        dst_aux_index = int(payload[5].decode("ascii")) if payload[5] else -1
        wire_error = None
        try:
            dst_state_indices = decode_state_indices(payload[6] if len(payload) > 6 else b"")
        except StateWireError as exc:
            dst_state_indices, wire_error = None, str(exc)
        return cls(
            room=room,
            endpoint=payload[1].decode("ascii"),
            dst_port=int(payload[2].decode("ascii")),
            engine_key=payload[3].decode("ascii"),
            dst_kv_indices=dst_kv_indices,
            dst_aux_index=dst_aux_index,
            dst_state_indices=dst_state_indices,
            required_dst_info_num=int(payload[7].decode("ascii")) if len(payload) > 7 else 1,
            is_dummy=dst_kv_indices.size == 0 and dst_aux_index < 0,
            wire_error=wire_error,
        )


# Frames after the guard in this wire's registration (MoriExtKVReceiver._register_kv_args);
# F12's row-size frame (core.aux_rows) follows them.
REGISTRATION_FIELDS = 13


@dataclasses.dataclass
class MoriExtKVArgsRegisterInfo(_conn.KVArgsRegisterInfo):
    """Decode's registration, state fields per component:
    ``dst_state_mem_descs[i][j]`` (``None`` for a zero-length tensor),
    ``dst_state_item_lens[i][j]``, ``dst_state_dim_per_tensor[i][j]``."""

    @classmethod
    def from_zmq(cls, payload: List[bytes]) -> "MoriExtKVArgsRegisterInfo":
        if len(payload) < REGISTRATION_FIELDS:
            raise StateWireError(
                f"registration has {len(payload)} fields, the per-component state wire has {REGISTRATION_FIELDS}"
            )
        # State fields first: a peer on another format is refused for that reason.
        packed = decode_mem_descs_per_component(payload[6])
        item_lens = decode_ints_per_component(payload[11])
        dims = decode_ints_per_component(payload[12])
        if not (len(packed) == len(item_lens) == len(dims)):
            raise StateWireError(
                f"registration lists {len(packed)} descriptor, {len(item_lens)} item-length and "
                f"{len(dims)} dim components"
            )
        for i, (descs, lens, dim) in enumerate(zip(packed, item_lens, dims)):
            if len(descs) != len(lens) or (dim and len(dim) != len(descs)):
                raise StateWireError(
                    f"state component {i}: {len(descs)} descriptors, {len(lens)} item lengths, {len(dim)} dims"
                )
        state_descs = [[_unpack_desc(b, i, j) for j, b in enumerate(comp)] for i, comp in enumerate(packed)]
        return cls(
            endpoint=payload[1].decode("ascii"),
            dst_port=int(payload[2].decode("ascii")),
            engine_desc=EngineDesc.unpack(payload[3]),
            dst_kv_mem_descs=_conn._unpack_mem_desc_list(payload[4]),
            dst_aux_mem_descs=_conn._unpack_mem_desc_list(payload[5]),
            dst_state_mem_descs=state_descs,
            gpu_id=int(payload[7].decode("ascii")),
            decode_tp_size=int(payload[8].decode("ascii")),
            decode_tp_rank=int(payload[9].decode("ascii")),
            dst_kv_item_len=int(payload[10].decode("ascii")),
            dst_state_item_lens=item_lens,
            dst_state_dim_per_tensor=dims,
        )


def _peer_address(payload: List[bytes]) -> Tuple[str, int]:
    """(endpoint, rank port) of a decode: the first fields of both message kinds."""
    try:
        return payload[1].decode("ascii"), int(payload[2].decode("ascii"))
    except Exception:  # noqa: BLE001
        return "?", -1


# -- manager ----------------------------------------------------------------------------------


class MoriExtKVManager(TransferInfoFailureMixin, AuxRowCheckMixin, MoriKVManager):
    """MoRI manager with per-component state, and F12's metadata-row checks
    (:class:`.aux_rows.AuxRowCheckMixin`, F12 is live on 0.5.12.x too); see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup (``_init_kv_manager``); the stock constructor calls
        ``_register_local_buffers`` and then starts the bootstrap (prefill) or
        decode thread, so everything they read must exist first.
        """
        # Set before super().__init__: it starts the bootstrap / decode threads.
        self._refused_peers: Dict[Tuple[str, int], str] = {}
        self._refused_lock = threading.Lock()
        self._prefill_wire: Dict[str, Optional[str]] = {}
        super().__init__(*args, **kwargs)
        activation_log.announce(self)

    # -- local buffers ---------------------------------------------------------------
    def _register_local_buffers(self) -> None:
        """Contract: stock ``MoriKVManager.__init__`` calls it once, both sides, on
        the scheduler thread at startup (``_init_kv_manager``), after the IO
        engine exists and before the bootstrap / decode thread starts. It may
        raise (startup fails) but must leave ``state_mem_descs`` one list per
        component, aligned with ``state_item_lens``, and hand no zero-length
        state tensor to ``register_memory``.
        """
        args = self.kv_args
        n = len(getattr(args, "state_types", []) or [])
        shapes = (len(args.state_data_ptrs), len(getattr(args, "state_data_lens", [])), len(args.state_item_lens))
        if any(x != n for x in shapes):
            raise StateTransferError(
                f"kv_args describe {n} state components but {shapes[0]} pointer, {shapes[1]} length and "
                f"{shapes[2]} item-length lists"
            )
        for ptr, length in zip(args.kv_data_ptrs, args.kv_data_lens):
            self.kv_mem_descs.append(self.engine.register_memory(ptr, length, args.gpu_id, MemoryLocationType.GPU))
        for ptr, length in zip(args.aux_data_ptrs, args.aux_data_lens):
            self.aux_mem_descs.append(self.engine.register_memory(ptr, length, -1, MemoryLocationType.CPU))
        self.state_mem_descs = []
        for ptrs, lens in zip(args.state_data_ptrs, args.state_data_lens):
            self.state_mem_descs.append(
                [
                    # A zero-length tensor (e.g. an elided index buffer) keeps its
                    # slot so descriptors stay aligned with item lengths.
                    None if length == 0 else self.engine.register_memory(ptr, length, args.gpu_id, MemoryLocationType.GPU)
                    for ptr, length in zip(ptrs, lens)
                ]
            )

    # -- prefill: registration and transfer messages ------------------------------
    def _handle_register_message(self, payload: List[bytes]) -> None:
        """Contract: prefill only, on stock's ``bootstrap_worker`` thread, for a
        message whose MORI_GUARD was checked and whose room field is ``None``
        (a decode rank registering); ``payload`` is otherwise unparsed. No lock
        held. Never block: the thread serves every later room. Stock's worker
        only logs an exception, so a refusal is recorded here, not raised.
        """
        try:
            info = MoriExtKVArgsRegisterInfo.from_zmq(payload)
            self._check_peer_components(info)
        except StateWireError as exc:
            self._refuse_peer(
                _peer_address(payload), f"its registration is not the per-component MoRI state wire ({exc})"
            )
            return
        except PeerRefused as exc:
            self._refuse_peer(_peer_address(payload), str(exc))
            return
        except Exception:  # noqa: BLE001 - as stock: never kill the bootstrap thread
            logger.exception("Failed to register remote peer")
            return
        with self._refused_lock:
            self._refused_peers.pop((info.endpoint, info.dst_port), None)
        self._add_remote_peer(info)
        self._note_aux_lens(payload, REGISTRATION_FIELDS)

    def _check_peer_components(self, info: MoriExtKVArgsRegisterInfo) -> None:
        mine = [len(c) for c in self.state_mem_descs]
        theirs = [len(c) for c in info.dst_state_mem_descs]
        if len(mine) != len(theirs):
            kinds = [state_kind_name(t) for t in self.kv_args.state_types]
            raise PeerRefused(
                f"decode registered {len(theirs)} state components (buffers per component {theirs}), "
                f"this prefill has {len(mine)} ({', '.join(kinds) or 'none'}; buffers {mine}): "
                "prefill and decode must serve the same model"
            )

    def _refuse_peer(self, address: Tuple[str, int], detail: str, stage: str = "registration") -> None:
        reason = f"mori-ext refused decode peer {address[0]}:{address[1]} at {stage}: {detail}"
        with self._refused_lock:
            first = address not in self._refused_peers
            self._refused_peers[address] = reason
        if first:
            logger.error(reason)

    def _handle_transfer_message(self, payload: List[bytes]) -> None:
        """Contract: prefill only, on ``bootstrap_worker``: a decode's
        ``send_metadata`` for one room (guard checked, payload unparsed), possibly
        before the scheduler created the room's sender. Mutate
        ``transfer_infos`` / status only under ``transfer_lock`` and never after
        the room left Bootstrapping (a sender may be using them); never raise: a
        message that cannot be handled fails its room on both sides
        (:class:`~.transfer_info.TransferInfoFailureMixin`).
        """
        try:
            self._accept_transfer_info(payload)
        except Exception as exc:  # noqa: BLE001 - the bootstrap loop must survive it
            self._fail_transfer_room(payload, exc)

    def _accept_transfer_info(self, payload: List[bytes]) -> None:
        info = MoriExtTransferInfo.from_zmq(payload)
        address = (info.endpoint, info.dst_port)
        if info.wire_error is not None:
            with self._refused_lock:
                refused = address in self._refused_peers
            if not refused:
                self._refuse_peer(
                    address,
                    f"it is not the per-component MoRI state wire ({info.wire_error})",
                    stage=f"its request for room {info.room}",
                )
        # Stock bookkeeping (0.5.12.post1 mori/conn.py:410-434), with our info type.
        with self.transfer_lock:
            current = self.request_status.get(info.room)
            if current is not None and current != KVPoll.Bootstrapping:
                logger.debug("Ignoring stale transfer info for room %s (status=%s)", info.room, current)
                return
            infos = self.transfer_infos.setdefault(info.room, {})
            infos[info.engine_key] = info
            if len(infos) >= info.required_dst_info_num:
                self.update_status(info.room, KVPoll.WaitingForInput)

    def _refusal_for_room(self, room: int) -> Optional[str]:
        with self.transfer_lock:
            infos = list((self.transfer_infos.get(room) or {}).values())
        with self._refused_lock:
            for info in infos:
                reason = self._refused_peers.get((info.endpoint, info.dst_port))
                if reason:
                    return reason
        return None

    # -- prefill: sending -----------------------------------------------------------
    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices,
        index_slice: slice,
        is_last: bool,
        aux_index: Optional[int] = None,
        state_indices=None,
    ):
        """Contract: prefill scheduler thread, from ``MoriExtKVSender.send`` per
        chunk; ``state_indices`` (per component) only on the last one. Returns
        stock's ``(statuses, infos)``: submitted transfers, which the sender's
        ``poll`` waits on before Success (stock's manager status Success here
        only means submitted). Never raise into the scheduler: a refused
        decode peer ends the room Failed instead.
        """
        if bootstrap_room in self.request_status:
            reason = self._refusal_for_room(bootstrap_room)
            if reason is not None:
                with self.transfer_lock:
                    infos = list((self.transfer_infos.get(bootstrap_room) or {}).values())
                    self.record_failure(bootstrap_room, reason)
                    self.update_status(bootstrap_room, KVPoll.Failed)
                return [], infos or None
        return super().add_transfer_request(
            bootstrap_room, kv_indices, index_slice, is_last, aux_index=aux_index, state_indices=state_indices
        )

    def send_state(self, peer_info, src_state_indices, dst_state_indices):
        """Per component: Mamba -> single slot, SWA/NSA/DSA/DSv4 -> contiguous pages.

        Contract: stock ``add_transfer_request`` calls it on the prefill scheduler
        thread, last chunk, per non-dummy decode rank, when state indices were
        given and ``state_mem_descs`` is non-empty, inside a ``try`` that turns
        any exception into Failed for the room. Returns the submitted transfer
        statuses. Never mutate the index lists (shared by every decode rank);
        write only into the decode's pages/slots named in ``dst_state_indices``.
        """
        if not self.state_mem_descs:
            return []
        state_types = list(getattr(self.kv_args, "state_types", []) or [])
        if len(peer_info.dst_state_mem_descs) != len(self.state_mem_descs):
            raise StateTransferError(
                f"state component count mismatch: prefill {len(self.state_mem_descs)}, "
                f"decode {len(peer_info.dst_state_mem_descs)}"
            )
        statuses = []
        for plan in plan_state_transfer(state_types, src_state_indices, dst_state_indices):
            if plan.route is Route.SKIP:
                continue
            src_descs = self.state_mem_descs[plan.component]
            dst_descs = peer_info.dst_state_mem_descs[plan.component]
            if len(src_descs) != len(dst_descs):
                raise StateTransferError(
                    f"state component {plan.component} ({plan.kind}): prefill registered {len(src_descs)} "
                    f"buffers, decode {len(dst_descs)}; MoRI pairs state buffers by position "
                    "(pipeline-parallel stages with different layers are not supported)"
                )
            if plan.route is Route.SINGLE_SLOT:
                statuses.extend(self._send_single_slot_component(peer_info, plan, src_descs, dst_descs))
            else:
                statuses.extend(self._send_paged_component(peer_info, plan, src_descs, dst_descs))
        return statuses

    def _send_single_slot_component(self, peer_info, plan: ComponentPlan, src_descs, dst_descs):
        i = plan.component
        src_lens = self.kv_args.state_item_lens[i]
        dst_lens = _component(peer_info.dst_state_item_lens, i)
        src_dims = _component(getattr(self.kv_args, "state_dim_per_tensor", None), i)
        dst_dims = _component(peer_info.dst_state_dim_per_tensor, i)
        statuses = []
        for j, (src_desc, dst_desc) in enumerate(zip(src_descs, dst_descs)):
            if src_desc is None or dst_desc is None:
                continue
            try:
                local, remote, size = mamba_slot_block(
                    int(plan.src[0]),
                    int(plan.dst[0]),
                    src_lens[j],
                    dst_lens[j] if j < len(dst_lens) else None,
                    src_dim=src_dims[j] if j < len(src_dims) else None,
                    dst_dim=dst_dims[j] if j < len(dst_dims) else None,
                    prefill_tp_size=self.attn_tp_size,
                    decode_tp_size=peer_info.decode_tp_size,
                    prefill_tp_rank=self.kv_args.engine_rank % self.attn_tp_size,
                    decode_tp_rank=peer_info.decode_tp_rank % peer_info.decode_tp_size,
                )
            except StateTransferError as exc:
                raise StateTransferError(f"state component {i} ({plan.kind}) buffer {j}: {exc}") from None
            statuses.extend(
                self._submit_batch_transfer_plan(src_desc, dst_desc, _conn.BatchTransferPlan([local], [remote], [size]))
            )
        return statuses

    def _send_paged_component(self, peer_info, plan: ComponentPlan, src_descs, dst_descs):
        i = plan.component
        if plan.kind == "swa" and not self.is_mla_backend and peer_info.decode_tp_size != self.attn_tp_size:
            raise StateTransferError(
                f"state component {i} (swa): different attention TP sizes (prefill {self.attn_tp_size}, "
                f"decode {peer_info.decode_tp_size}) are not supported for non-MLA SWA state"
            )
        src_lens = self.kv_args.state_item_lens[i]
        check_paged_item_lens(i, plan.kind, src_lens, _component(peer_info.dst_state_item_lens, i))
        if plan.trimmed:
            logger.warning(plan.describe_trim())
        statuses = []
        for j, (src_desc, dst_desc) in enumerate(zip(src_descs, dst_descs)):
            if src_desc is None or dst_desc is None or not src_lens[j]:
                continue
            local, remote, sizes = paged_byte_blocks(plan.src, plan.dst, src_lens[j])
            statuses.extend(
                self._submit_batch_transfer_plan(src_desc, dst_desc, _conn.BatchTransferPlan(local, remote, sizes))
            )
        return statuses

    # -- decode: is the prefill on this wire? -----------------------------------------
    def prefill_wire_problem(self, bootstrap_addr: str) -> Optional[str]:
        """``None`` when the prefill behind ``bootstrap_addr`` speaks this wire (or
        cannot be asked right now), else why this decode must not register there."""
        if bootstrap_addr in self._prefill_wire:
            return self._prefill_wire[bootstrap_addr]
        answered, version = probe_prefill_version(bootstrap_addr, WIRE_ROUTE, "state_wire_version",
                                                  WIRE_PROBE_TIMEOUT_S, logger)
        if not answered:
            return None
        if version is None:
            problem = (
                f"the prefill behind bootstrap server {bootstrap_addr} does not speak the per-component "
                f"MoRI state wire v{WIRE_VERSION} of sglang_disagg_ext (its bootstrap server has no "
                f"{WIRE_ROUTE}): it runs stock `mori`, which on SGLang 0.5.12.x sends hybrid state as "
                "one flat list. Start the prefill with --disaggregation-transfer-backend mori-ext too"
            )
        else:
            problem = (
                None
                if version == WIRE_VERSION
                else f"the prefill behind bootstrap server {bootstrap_addr} speaks MoRI state wire "
                f"v{version}, this decode v{WIRE_VERSION}: run the same sglang_disagg_ext on both sides"
            )
        self._prefill_wire[bootstrap_addr] = problem
        if problem:
            logger.error("mori-ext: %s", problem)
        return problem


# -- sender / receiver / bootstrap server -------------------------------------------------------------


class MoriExtKVSender(MoriKVSender):
    def send(self, kv_indices, state_indices: Optional[List] = None):
        """Stock ``send`` (0.5.12.post1 mori/conn.py:1241-1279), per-component state indices.

        Contract: prefill scheduler thread, from ``send_kv_chunk`` once per chunk
        after the room left Bootstrapping; ``state_indices`` (one entry per
        component, ``None`` = none) only with the last chunk. Must not raise or
        wait for transfers, and must not mutate the caller's arrays.

        Stock flattens ``state_indices`` with ``np.asarray`` (:1264), which
        fails on ragged per-component lists; this passes them, normalised per
        component, straight to the manager's ``add_transfer_request``. The
        rest is stock's body unchanged.
        """
        index_slice = slice(self.curr_idx, self.curr_idx + len(kv_indices))
        self.curr_idx += len(kv_indices)
        is_last = self.curr_idx == self.num_kv_indices

        if self.kv_mgr.enable_all_cp_ranks_for_transfer:
            kv_indices, index_slice = _conn.filter_kv_indices_for_cp_rank(self.kv_mgr, kv_indices, index_slice)
        elif self.kv_mgr.is_dummy_cp_rank:
            if is_last:
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
            return

        statuses, infos = self.kv_mgr.add_transfer_request(
            self.bootstrap_room,
            kv_indices,
            index_slice,
            is_last,
            aux_index=self.aux_index if is_last else None,
            state_indices=normalize_state_indices(state_indices) if is_last else None,
        )
        self.transfer_statuses.extend(statuses)
        self._record_transfer_indices(kv_indices, None)
        if infos is not None:
            self.pending_infos = infos
            if is_last:
                self.sent_last_chunk = True
        self._maybe_finalize_if_room_failed()


class MoriExtKVReceiver(MoriKVReceiver):
    def init(self, prefill_dp_rank: int):
        """Contract: decode scheduler thread, once per request, from
        ``DecodePreallocQueue.add`` or ``_resolve_pending_reqs`` once the prefill
        DP rank is known. Stock ``init`` may query the bootstrap server over HTTP
        and register (``_register_kv_args``); the wire probe before it blocks at
        most ``WIRE_PROBE_TIMEOUT_S`` and is cached per prefill after a definite
        answer. Never raise: a refused prefill ends the request Failed.
        """
        problem = self.kv_mgr.prefill_wire_problem(self.bootstrap_addr)
        if problem is not None:
            if self.bootstrap_room is not None:
                self.kv_mgr.record_failure(self.bootstrap_room, f"mori-ext refused at registration: {problem}")
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return
        super().init(prefill_dp_rank)

    def _register_kv_args(self):
        """Contract: decode scheduler thread, from stock ``init`` (via
        ``_setup_bootstrap_infos``) the first time this manager meets a
        bootstrap key; ``bootstrap_infos`` were fetched from the bootstrap
        server. Sends one registration per prefill rank under each socket's lock;
        all fields but the state ones are byte-for-byte stock's.
        """
        if self.bootstrap_infos is None:
            return
        mgr = self.kv_mgr
        args = mgr.kv_args
        packed_state_descs = encode_mem_descs_per_component(
            [[None if d is None else d.pack() for d in comp] for comp in mgr.state_mem_descs]
        )
        packed_item_lens = encode_ints_per_component(args.state_item_lens)
        dims = list(getattr(args, "state_dim_per_tensor", []) or [])
        dims += [[]] * (len(args.state_item_lens) - len(dims))
        packed_dims = encode_ints_per_component(dims)
        frames = [
            MORI_GUARD,
            b"None",
            mgr.local_ip.encode("ascii"),
            str(mgr.rank_port).encode("ascii"),
            mgr.engine_desc.pack(),
            _conn._pack_mem_desc_list(mgr.kv_mem_descs),
            _conn._pack_mem_desc_list(mgr.aux_mem_descs),
            packed_state_descs,
            str(args.gpu_id).encode("ascii"),
            str(mgr.attn_tp_size).encode("ascii"),
            str(args.engine_rank).encode("ascii"),
            str(args.kv_item_lens[0]).encode("ascii"),
            packed_item_lens,
            packed_dims,
            # F12: this decode's metadata row sizes (a stock prefill reads the fields above only).
            encode_aux_item_lens(args.aux_item_lens),
        ]
        for bootstrap_info in self.bootstrap_infos:
            sock, lock = self._connect_to_bootstrap_server(bootstrap_info)
            with lock:
                sock.send_multipart(frames)

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None):
        """Contract: decode scheduler thread, from ``DecodePreallocQueue.pop_preallocated``
        once the request's pages, metadata slot and per-component state slots are
        allocated (``state_indices``: one entry per ``kv_args.state_types``
        component, ``None`` = none). Must not mutate the index arrays or block
        beyond the ZMQ sends; dummy ranks get no indices, as in stock.
        """
        if self.bootstrap_infos is None or self.bootstrap_room is None:
            return
        kv_indices_bytes = np.asarray(kv_indices, dtype=np.int32).tobytes() if kv_indices.size else b""
        aux_bytes = str(aux_index).encode("ascii") if aux_index is not None else b""
        state_bytes = encode_state_indices(normalize_state_indices(state_indices))
        no_state = encode_state_indices(None)
        mgr = self.kv_mgr
        for bootstrap_info in self.bootstrap_infos:
            sock, lock = self._connect_to_bootstrap_server(bootstrap_info)
            is_dummy = bootstrap_info.get("is_dummy", False)
            with lock:
                sock.send_multipart(
                    [
                        MORI_GUARD,
                        str(self.bootstrap_room).encode("ascii"),
                        mgr.local_ip.encode("ascii"),
                        str(mgr.rank_port).encode("ascii"),
                        mgr.engine_desc.key.encode("ascii"),
                        kv_indices_bytes if not is_dummy else b"",
                        aux_bytes if not is_dummy else b"",
                        no_state if is_dummy else state_bytes,
                        str(self.required_dst_info_num).encode("ascii"),
                    ]
                )
        self.init_time = time.time()


class MoriExtKVBootstrapServer(MoriKVBootstrapServer):
    """SGLang's bootstrap server plus ``WIRE_ROUTE``, so a decode can tell this
    prefill speaks the per-component state wire before it registers."""

    def _setup_routes(self):
        """Contract: stock ``CommonKVBootstrapServer.__init__`` calls it once, in
        the prefill's tokenizer-manager process (``start_disagg_service``),
        before the aiohttp server thread starts. Only add routes; keep stock's.
        """
        super()._setup_routes()
        self.app.router.add_get(WIRE_ROUTE, self._handle_state_wire)

    async def _handle_state_wire(self, request):
        from aiohttp import web

        return web.json_response(
            {"plugin": "sglang_disagg_ext", "backend": "mori-ext", "state_wire_version": WIRE_VERSION}
        )


def ext_classes(policy: ReleasePolicy) -> Dict[str, type]:
    """Names in ``sglang.srt.disaggregation.mori`` to route to the plugin.

    Where F3 is live (0.5.12.x) the F3 classes below (which carry F12's row checks);
    elsewhere, where F12 is live, ``backends.mori.metadata_order``'s classes over stock's.
    """
    if policy.is_live("F12") and not policy.is_live("F3"):
        from sglang_disagg_ext.backends.mori.metadata_order import ext_classes as ordered_classes

        classes = ordered_classes()
        classes["MoriKVManager"] = _with_verification(classes["MoriKVManager"], policy)
        return classes
    # F3 live only: on patched sources (F3 upstream there) the stock MoRI
    # classes carry the fix and the plugin's wire format must not be imposed.
    if not policy.is_live("F3"):
        return {}
    return {
        "MoriKVManager": _with_verification(MoriExtKVManager, policy),
        "MoriKVSender": MoriExtKVSender,
        "MoriKVReceiver": MoriExtKVReceiver,
        "MoriKVBootstrapServer": MoriExtKVBootstrapServer,
    }


def _with_verification(cls: type, policy: ReleasePolicy) -> type:
    from sglang_disagg_ext import verification

    def mixin() -> type:
        from sglang_disagg_ext.backends.mori.verify import MoriVerifiedTransferMixin

        return MoriVerifiedTransferMixin

    return verification.with_verification(cls, "mori-ext", policy, mixin, logger)
