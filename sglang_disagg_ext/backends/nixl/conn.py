"""``nixl-ext``: SGLang's NIXL manager with the heterogeneous-TP fixes of F4.

What changes against stock ``NixlKVManager`` (0.5.10.post1, 0.5.11, 0.5.12.x):

* **Head slice** (``send_kvcache_slice``): which KV heads a prefill rank writes
  into a decode rank, and where, comes from ``core.head_slice.HeadLayout``:
  the model's *total* KV-head count (``kv_args.total_kv_head_num``; fallback
  per-rank count x prefill TP), GQA replication on either side, and only one
  of several prefill ranks holding the same head sends it. Stock 0.5.10.post1
  treats a replicated half head as a head (silent corruption); 0.5.11 and
  0.5.12.x map decode-side replicas by modulo (e.g. 2 heads, prefill TP 1 ->
  decode TP 4: decode rank 1 gets head 1 and rank 2 head 0, the other way
  round; 0.5.11 conn.py:555, 0.5.12.post1 conn.py:1003).
* **SWA state across TP sizes**: stock raises for non-MLA SWA state
  whenever prefill and decode TP sizes differ, so a hybrid SWA model cannot run
  heterogeneous TP over NIXL. An SWA window cache is attention KV (``2 *
  layers`` paged buffers, the same heads), so ``maybe_send_extra`` sends its
  SWA components as head slices with the KV layout (``_ext_post_head_slice``,
  shared with ``send_kvcache_slice``); other state kinds go to stock.
* **Notification key**: every NIXL notification this prefill rank emits
  carries ``notification_sender_id(pp_rank, engine_rank)`` in its sender
  field (``core.nixl_notif.with_sender_id``), whatever method of whatever
  release built the tag. Stock keys on the pipeline rank (<= 0.5.11: decode
  with fewer TP ranks never completes) or the TP rank (0.5.12.x: collides
  across pipeline stages). Stock decode parses the field with ``int()`` and
  counts distinct values, so a stock decode completes on these keys.
  A prefill rank that sends no bytes to a decode rank (a GQA replica, or an
  empty chunk) still sends that notification, as a standalone NIXL
  notification, because stock decode counts one response per prefill rank.
* **Memory kinds**: KV and state buffers are registered as "DRAM" or "VRAM"
  according to where they live (``core.mem_kind``), and every transfer names
  the kind each side registered (the decode's kinds are read from NIXL's copy
  of its metadata), instead of "VRAM" everywhere.
* **Failures**: an impossible head layout is refused when the prefill manager
  registers its buffers (own TP size) or when a decode registers (the pair of
  TP sizes), naming the numbers; a room that cannot be served ends Failed on
  prefill and sends ``<room>_fail_...`` to its decode ranks, which an ext
  decode turns into Failed at once (stock decode ignores the tag and times
  out). On <= 0.5.11 stock raises such errors into the scheduler instead.
* **Destination bounds** (found by the soak): nothing in stock
  compares a decode index with decode's pool, and NIXL checks a remote
  descriptor only against the peer's *registered regions*, so an index past
  one KV buffer lands in the next registered buffer and both sides report
  Success (measured on 0.5.10.post1: valid requests' pages overwritten). The
  ``-ext`` decode appends its pool sizes to its registration message as one
  trailing frame (``core.index_bounds``; stock prefill parses fixed positions
  and never reads it); the ``-ext`` prefill notes the frame as the
  registration arrives and fails a room whose KV or aux index lies outside
  before any descriptor is built, naming the index and the pool size. A stock
  decode publishes nothing: its rooms run unchecked, as stock, named once.
  State indices are not checked here (these releases register state as one
  flat buffer list; no per-component bound).
* **Every prefill rank concludes** (found by the soak): every prefill
  rank feeding a decode rank writes the same aux row, and stock decode completes
  a room on the first ``<room>_aux`` notification, so one rank's row could end
  the room Success on decode while another rank's post of it failed and that
  rank failed it on prefill (a split; 12 of 512 on 0.5.12.post1 at TP 2 -> 1),
  and one rank's failure notice could free pages another rank still wrote into.
  The ``-ext`` decode gates aux and failure notifications per room
  (``core.nixl_quorum.RoomQuorum``, in ``ExtNixlAgent.get_new_notifs``): aux is
  released once every prefill rank SGLang expects for the room sent one, a
  failure once every such rank concluded or after a 5 s grace.
* **Bootstrap deadline** (also found by the soak): stock's NIXL sender has none
  on these releases, so a room whose decode died before sending its metadata
  stays Bootstrapping, its KV pinned, for ever. The ``-ext`` sender fails it
  after SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, counted from the
  sender's first poll (Mooncake's counts from construction, one scheduler pass
  earlier).

Release differences the adapter meets (state-pointer layout, the method and
field that build notification tags, the sender's failure path) are handled
where they appear, by the shape of the arguments SGLang passes, never by
version; what stock NIXL does per release is read in ``releases.features()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver, NixlKVSender
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import activation_log
from sglang_disagg_ext.core import mem_kind
from sglang_disagg_ext.core.head_slice import (
    HeadLayout,
    HeadLayoutError,
    head_bytes_from_item_len,
    head_layout_for,
    head_slice_rows,
    resolve_total_kv_heads,
    transfer_requests,
)
from sglang_disagg_ext.backends.nixl.bootstrap_screen import BootstrapScreenMixin
from sglang_disagg_ext.backends.common.shared import FilteringSocket, note_peer_bounds, pool_bounds_frame, register_appending
from sglang_disagg_ext.core.index_bounds import check_destination
from sglang_disagg_ext.core.nixl_notif import aux_room, failure_tag, parse_failure_tag, with_sender_id
from sglang_disagg_ext.core.nixl_quorum import AUX, RoomQuorum
from sglang_disagg_ext.releases import ReleasePolicy

logger = logging.getLogger("sglang_disagg_ext.nixl")


# --- release features (the one place that looks at the installed SGLang) ------


def _flatten_ptrs(ptrs) -> List[int]:
    """State pointers: flat list (<= 0.5.11) or one list per component (0.5.12+)."""
    out: List[int] = []
    for p in ptrs or []:
        if isinstance(p, (list, tuple)):
            out.extend(int(x) for x in p)
        else:
            out.append(int(p))
    return out


def _flatten_state(kv_args):
    """(ptr, len) of every non-empty state buffer, either layout."""
    ptrs = kv_args.state_data_ptrs or []
    lens = kv_args.state_data_lens or []
    pairs = []
    for p, n in zip(ptrs, lens):
        if isinstance(p, (list, tuple)):
            pairs.extend(zip(p, n))
        else:
            pairs.append((p, n))
    return [(int(p), int(n)) for p, n in pairs if p and n]


# --- device-memory probe ---------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cuda_pointer_probe():
    """``ptr -> True/False/None`` from the CUDA driver, or ``None`` without one.

    Only a positive answer from ``cuPointerGetAttribute(MEMORY_TYPE)`` is
    used; any error means "unknown" and the server's device decides.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuPointerGetAttribute
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    cu_pointer_attribute_memory_type = 2
    host, device, unified = 1, 2, 4

    def probe(ptr: int) -> Optional[bool]:
        value = ctypes.c_uint(0)
        if fn(ctypes.byref(value), cu_pointer_attribute_memory_type, ctypes.c_uint64(ptr)) != 0:
            return None
        if value.value in (device, unified):
            return True
        if value.value == host:
            return False
        return None

    return probe


# --- the agent as the manager sees it ----------------------------------------------


class _NotifOnly:
    """Handle of a notification sent without a transfer (replica, empty chunk)."""

    __slots__ = ("peer", "tag")

    def __init__(self, peer: str, tag: bytes):
        self.peer, self.tag = peer, tag

    def __repr__(self) -> str:
        return f"<notification-only {self.tag!r} to {self.peer}>"


class _KindPlan:
    """Memory kinds for the next (local, remote) descriptor-list pairs on this thread."""

    __slots__ = ("kinds", "calls")

    def __init__(self, src: str, dst: str):
        self.kinds = (src, dst)
        self.calls = 0


class ExtNixlAgent:
    """The manager's ``nixl_agent``, with three rules applied on the way through.

    * Descriptor lists asked for as "VRAM" (stock's constant) inside a
      ``kinds()`` block get the block's kinds, local list first then remote,
      as every stock send method builds them; host rows get device id 0.
    * Prefill: every notification tag leaving the process gets this rank's
      sender id (``with_sender_id``); ``send_notif`` returns a handle that
      ``check_xfer_state`` reports as done.
    * Decode: aux and ``<room>_fail_...`` notifications go through the
      manager's ``RoomQuorum`` (``_ext_gate_notifs``): a room's aux is
      released once every prefill rank it expects sent one, a failure once
      every such rank concluded (or after a grace).
    Everything else is the wrapped agent's own attribute.
    """

    def __init__(self, agent, mgr: "NixlExtKVManager"):
        self._agent = agent
        self._mgr = mgr
        self._local = threading.local()

    def __getattr__(self, name):
        return getattr(self._agent, name)

    # -- memory kinds --------------------------------------------------------
    @contextlib.contextmanager
    def kinds(self, src: str, dst: str):
        """Inside the block, stock's "VRAM" descriptor lists become (src, dst) pairs."""
        stack = self._plans()
        stack.append(_KindPlan(src, dst))
        try:
            yield
        finally:
            stack.pop()

    def _plans(self) -> list:
        stack = getattr(self._local, "plans", None)
        if stack is None:
            stack = self._local.plans = []
        return stack

    def get_xfer_descs(self, descs, mem_type=None, *args, **kwargs):
        plans = self._plans()
        if plans and mem_type == mem_kind.VRAM:
            plan = plans[-1]
            mem_type = plan.kinds[plan.calls % 2]
            plan.calls += 1
            if mem_type == mem_kind.DRAM:
                descs = _host_device_ids(descs)
        return self._agent.get_xfer_descs(descs, mem_type, *args, **kwargs)

    # -- notifications (prefill) ---------------------------------------------------
    def _tag(self, tag):
        if not tag or not self._mgr._ext_is_prefill:
            return tag
        return with_sender_id(tag, self._mgr._ext_pp_rank, self._mgr._ext_engine_rank)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", *args, **kwargs):
        return self._agent.initialize_xfer(
            operation, local_descs, remote_descs, remote_agent, self._tag(notif_msg), *args, **kwargs
        )

    def make_prepped_xfer(self, *args, **kwargs):
        if "notif_msg" in kwargs:
            kwargs["notif_msg"] = self._tag(kwargs["notif_msg"])
        elif len(args) > 5:
            args = args[:5] + (self._tag(args[5]),) + args[6:]
        return self._agent.make_prepped_xfer(*args, **kwargs)

    def transfer(self, handle, notif_msg=b""):
        if isinstance(handle, _NotifOnly):
            return "DONE"
        return self._agent.transfer(handle, self._tag(notif_msg))

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        tag = self._tag(notif_msg)
        if isinstance(tag, str):
            tag = tag.encode("ascii")
        self._agent.send_notif(remote_agent_name, tag, backend)
        return _NotifOnly(remote_agent_name, tag)

    def check_xfer_state(self, handle):
        if isinstance(handle, _NotifOnly):
            return "DONE"
        return self._agent.check_xfer_state(handle)

    def release_xfer_handle(self, handle):
        if isinstance(handle, _NotifOnly):
            return None
        return self._agent.release_xfer_handle(handle)

    # -- notifications (decode) ------------------------------------------------------
    def get_new_notifs(self, *args, **kwargs):
        notifs = self._agent.get_new_notifs(*args, **kwargs)
        if self._mgr._ext_is_prefill:
            return notifs
        return self._mgr._ext_gate_notifs(notifs or {})


def _host_device_ids(descs):
    """Descriptors with device id 0 (NIXL's id for host memory)."""
    if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3:
        if descs.size and np.any(descs[:, 2] != 0):
            descs = descs.copy()
            descs[:, 2] = 0
        return descs
    if isinstance(descs, list) and descs and isinstance(descs[0], tuple) and len(descs[0]) == 3:
        return [(a, n, 0) for a, n, _ in descs]
    return descs


# --- manager ---------------------------------------------------------------------------


class NixlExtKVManager(BootstrapScreenMixin, NixlKVManager):
    """See the module docstring."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup (``PrefillBootstrapQueue`` / ``DecodePreallocQueue``
        ``._init_kv_manager``). The stock constructor calls
        ``register_buffer_to_engine`` and then starts the bootstrap thread (and on
        0.5.12.x the transfer workers) on prefill, the heartbeat thread on decode.
        """
        # Set before super().__init__: the stock constructor registers memory
        # and starts the bootstrap thread, which use these.
        self._ext_is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self._ext_pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self._ext_engine_rank = int(getattr(args, "engine_rank", 0) or 0)
        self._ext_lock = threading.Lock()
        self._ext_local_kinds: Dict[int, str] = {}
        self._ext_peer_kinds: Dict[str, Dict[int, str]] = {}
        self._ext_peer_errors: Dict[str, str] = {}
        self._ext_failed_rooms: Dict[int, str] = {}
        self._ext_notified_rooms: set = set()
        # room -> decode agent names of its last chunk, until the room ends (record_failure,
        # the sender's Success): who to tell when a posted transfer fails later.
        self._ext_posted_peers: Dict[int, List[str]] = {}
        self._ext_layouts: Dict[tuple, HeadLayout] = {}
        self._ext_total_kv_heads: Optional[int] = None
        # decode agent name -> PoolBounds it published; written by the bootstrap
        # thread, read by the scheduler thread (single dict operations).
        self._ext_peer_bounds: Dict[str, object] = {}
        self._ext_unchecked_peers: set = set()
        # Decode: aux and failure notifications held per room until every prefill rank
        # of the room concluded (core.nixl_quorum).
        self._ext_quorum = RoomQuorum()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        activation_log.announce(self)

    # -- registration ------------------------------------------------------------------
    def register_buffer_to_engine(self):
        """Register KV, aux and state buffers, each under the memory kind it lives in.

        Contract: stock ``NixlKVManager.__init__`` calls it once, both sides, on
        the scheduler thread at startup, after creating ``self.agent`` and before
        any SGLang thread of the manager starts; ``kv_args`` is final. It may
        raise (startup fails, as stock does when NIXL refuses memory), but must
        not return with a KV, aux or state buffer unregistered: every later
        transfer names these buffers by raw pointer.
        """
        if self._ext_is_prefill and not self.is_mla_backend:
            self._ext_check_own_heads()
        if not isinstance(self.agent, ExtNixlAgent):
            self.agent = ExtNixlAgent(self.agent, self)
        device = getattr(self.server_args, "device", None)
        probe = _cuda_pointer_probe()
        gpu_id = self.kv_args.gpu_id

        kv = [(int(p), int(n)) for p, n in zip(self.kv_args.kv_data_ptrs, self.kv_args.kv_data_lens)]
        self.kv_descs = self._ext_register("kv", kv, mem_kind.classify([p for p, _ in kv], device, probe), gpu_id)
        if not self.kv_descs and kv:
            raise Exception("NIXL memory registration failed for kv tensors")

        # Aux (metadata) buffers are host memory in every release: stock's DRAM.
        aux = [(int(p), int(n)) for p, n in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_data_lens)]
        self.aux_descs = self._ext_register("aux", aux, [mem_kind.DRAM] * len(aux), 0)
        if not self.aux_descs and aux:
            raise Exception("NIXL memory registration failed for aux tensors")

        state = _flatten_state(self.kv_args)
        if state:
            kinds = mem_kind.classify([p for p, _ in state], device, probe)
            self.state_descs = self._ext_register("state", state, kinds, gpu_id)
            if not self.state_descs:
                raise Exception("NIXL memory registration failed for state tensors")

    def _ext_register(self, what: str, bufs, kinds: Sequence[str], gpu_id: int):
        """Register ``bufs`` grouped by memory kind; remember each pointer's kind."""
        regs = []
        for kind in mem_kind.KINDS:
            group = [
                (p, n, mem_kind.device_id(kind, gpu_id), "") for (p, n), k in zip(bufs, kinds) if k == kind
            ]
            if not group:
                continue
            descs = self.agent.register_memory(group, kind)
            if not descs:
                raise Exception(f"NIXL memory registration failed for {what} tensors ({kind})")
            regs.append(descs)
            for p, _, _, _ in group:
                self._ext_local_kinds[p] = kind
            logger.debug("registered %d %s buffers as %s", len(group), what, kind)
        if not regs:
            return None
        return regs[0] if len(regs) == 1 else regs

    def _ext_check_own_heads(self) -> None:
        """Refuse a prefill head layout that cannot be sliced, naming the numbers."""
        per_rank = getattr(self.kv_args, "kv_head_num", None)
        total = getattr(self.kv_args, "total_kv_head_num", None)
        tp = self.attn_tp_size
        try:
            heads = resolve_total_kv_heads(total, per_rank if per_rank is not None else 0, tp)
            layout = HeadLayout(tp, tp, heads)
        except HeadLayoutError as exc:
            raise HeadLayoutError(
                f"nixl-ext: cannot serve prefill KV heads (kv_head_num={per_rank}, "
                f"total_kv_head_num={total}, attention TP size={tp}): {exc}"
            ) from None
        if per_rank is not None and per_rank != layout.prefill_heads_per_rank:
            raise HeadLayoutError(
                f"nixl-ext: prefill pool holds {per_rank} KV heads per rank, but {heads} total KV heads "
                f"over attention TP size {tp} means {layout.prefill_heads_per_rank} per rank"
            )
        self._ext_total_kv_heads = heads

    # -- decode peers ---------------------------------------------------------------------
    def _add_remote_peer(self, decode_kv_args):
        """Stock registration, then the decode's memory kinds and head layout.

        Runs on the bootstrap thread: an exception here (stock lets NIXL's
        ``add_remote_agent`` raise) would end that thread and leave every later
        room Bootstrapping, so a decode that cannot be served is recorded and
        its rooms fail with the reason instead.

        Contract: prefill only. Stock ``bootstrap_thread`` calls it for each
        registration message (room ``None``) from a decode rank, already parsed
        by ``KVArgsRegisterInfo.from_zmq``; a name already in
        ``decode_kv_args_table`` is ignored by stock. No lock is held while the
        scheduler (or transfer worker) may read the table. Never raise, never
        block on the peer.
        """
        name = decode_kv_args.agent_name
        new = name not in self.decode_kv_args_table
        try:
            super()._add_remote_peer(decode_kv_args)
            if new:
                self._ext_inspect_peer(decode_kv_args)
        except Exception as exc:  # noqa: BLE001 - keep the bootstrap thread alive; fail the peer's rooms
            self._ext_peer_errors[name] = f"decode {name} (TP rank {decode_kv_args.decode_tp_rank}) cannot be served: {exc}"
            logger.error("nixl-ext: %s", self._ext_peer_errors[name])

    def _start_bootstrap_thread(self):
        """Stock's bootstrap thread, reading through a socket that notes pool bounds.

        Contract: prefill only; the stock constructor calls it once, after
        ``CommonKVManager.__init__`` made ``server_socket`` and before any
        decode can register. The thread it starts reads ``self.server_socket``
        on every message, so the proxy sees every message first, and passes it
        on unchanged; it must never raise into that thread.
        """
        self.server_socket = FilteringSocket(self.server_socket, self._ext_note_registration, logger)
        super()._start_bootstrap_thread()

    def _ext_note_registration(self, msg) -> None:
        """Bootstrap thread: a decode registration's pool-bounds frame (or its absence)."""
        if len(msg) < 5 or bytes(msg[1]) != REGISTRATION_ROOM:
            return
        try:
            name = bytes(msg[4]).decode("ascii")
        except UnicodeDecodeError:
            return  # stock's own parse of this message reports it
        note_peer_bounds(self._ext_peer_bounds, self._ext_unchecked_peers, name, msg, logger, "nixl-ext: decode",
                         "nixl-ext: decode %s published no pool sizes (a stock decode): its destination indices "
                         "are not checked, as in stock SGLang")

    def _ext_destination_error(self, req) -> Optional[str]:
        """Why decode ``req.agent_name`` cannot take this room's indices, or None."""
        bounds = self._ext_peer_bounds.get(req.agent_name)
        if bounds is None:
            return None
        kv = getattr(req, "dst_kv_indices", None)
        aux = getattr(req, "dst_aux_index", None)
        why = check_destination(bounds, kv, aux if isinstance(aux, (int, np.integer)) else None, None)
        return None if why is None else f"decode {req.agent_name}: {why}"

    def _ext_inspect_peer(self, info) -> None:
        kinds: Dict[int, str] = {}
        for what, ptrs in (
            ("kv", [int(p) for p in info.dst_kv_ptrs]),
            ("state", [p for p in _flatten_ptrs(getattr(info, "dst_state_data_ptrs", [])) if p]),
        ):
            kinds.update(self._ext_remote_kinds(info.agent_name, what, ptrs, info.gpu_id))
        self._ext_peer_kinds[info.agent_name] = kinds
        if not self.is_mla_backend and info.decode_tp_size != self.attn_tp_size:
            layout = self._ext_layout(self.attn_tp_size, info.decode_tp_size)
            src_head = head_bytes_from_item_len(
                self.kv_args.kv_item_lens[0], self.kv_args.page_size, layout.prefill_heads_per_rank
            )
            dst_head = head_bytes_from_item_len(
                info.dst_kv_item_len, self.kv_args.page_size, layout.decode_heads_per_rank
            )
            if src_head != dst_head:
                raise HeadLayoutError(
                    f"one KV head is {src_head} bytes per token on prefill ({layout.prefill_heads_per_rank} "
                    f"heads per rank) but {dst_head} on decode rank {info.decode_tp_rank} "
                    f"({layout.decode_heads_per_rank} heads per rank)"
                )

    def _ext_remote_kinds(self, agent_name: str, what: str, ptrs: List[int], gpu_id: int) -> Dict[int, str]:
        """Each remote buffer's kind, read from NIXL's copy of the peer's metadata."""
        if not ptrs:
            return {}

        def registered(sel: List[int], kind: str) -> bool:
            dev = mem_kind.device_id(kind, gpu_id)
            rows = np.array([[p, 1, dev] for p in sel], dtype=np.int64)
            descs = self.agent._agent.get_xfer_descs(rows, kind)
            return bool(self.agent._agent.check_remote_metadata(agent_name, descs))

        for kind in (mem_kind.VRAM, mem_kind.DRAM):
            if registered(ptrs, kind):
                return {p: kind for p in ptrs}
        out = {}
        for p in ptrs:
            kind = next((k for k in (mem_kind.VRAM, mem_kind.DRAM) if registered([p], k)), None)
            if kind is None:
                raise mem_kind.MemKindError(
                    f"decode {what} buffer 0x{p:x} is not registered with NIXL (neither VRAM nor DRAM)"
                )
            out[p] = kind
        return out

    def _ext_layout(self, prefill_tp: int, decode_tp: int) -> HeadLayout:
        key = (prefill_tp, decode_tp)
        layout = self._ext_layouts.get(key)
        if layout is None:
            heads = self._ext_total_kv_heads
            if heads is None:
                heads = resolve_total_kv_heads(
                    getattr(self.kv_args, "total_kv_head_num", None),
                    getattr(self.kv_args, "kv_head_num", 0) or 0,
                    prefill_tp,
                )
            layout = head_layout_for(prefill_tp, decode_tp, heads, "nixl-ext")
            self._ext_layouts[key] = layout
        return layout

    def _ext_kinds(self, peer_name: str, src_ptrs, dst_ptrs, what: str):
        local = mem_kind.single_kind([p for p in src_ptrs if p], self._ext_local_kinds, f"prefill {what}")
        peer = self._ext_peer_kinds.get(peer_name, {})
        dst = [int(p) for p in dst_ptrs if p]
        if dst and all(p in peer for p in dst):
            remote = mem_kind.single_kind(dst, peer, f"decode {what}")
        else:
            remote = mem_kind.VRAM  # not inspected (e.g. legacy path): stock's assumption
        return self.agent.kinds(local, remote)

    # -- sends -------------------------------------------------------------------------------
    def _send_kvcache_generic(self, peer_name, src_data_ptrs, dst_data_ptrs, *args, **kwargs):
        """Stock page transfer, with each side's descriptors under its registered kind.

        Contract: prefill only. Stock ``send_kvcache`` (KV pages, MLA or equal TP)
        and ``maybe_send_extra`` (paged state) call it: on the scheduler thread
        inside ``add_transfer_request`` up to 0.5.11, on a ``transfer_worker``
        thread on 0.5.12.x. It returns a posted NIXL handle; completion is
        judged later from ``check_xfer_state`` (sender ``poll`` / the worker's
        wait loop), so it must never wait for the bytes nor report them landed.
        """
        with self._ext_kinds(peer_name, src_data_ptrs, dst_data_ptrs, "pages"):
            return super()._send_kvcache_generic(peer_name, src_data_ptrs, dst_data_ptrs, *args, **kwargs)

    def maybe_send_extra(
        self, peer_name, prefill_state_indices, dst_state_data_ptrs, dst_state_indices, dst_gpu_id, notif,
        decode_tp_size, *args, **kwargs
    ):
        """Stock state send, with the memory kinds of both sides' state buffers; SWA state
        across different TP sizes as head slices (F4's layout), where stock raises.

        Contract: prefill only, same thread as ``_send_kvcache_generic``: a room's
        last chunk carrying ``state_indices`` (from ``send_kv_chunk``), once per
        non-dummy decode rank, before ``send_aux``; ``peer_name`` is in
        ``decode_kv_args_table``. Returns what stock returns (a handle or None up
        to 0.5.11, a list of handles on 0.5.12.x), all already posted. Must not
        mutate the index arguments, which every decode rank of the room shares.
        Arguments after ``decode_tp_size`` differ per release (0.5.11+:
        ``decode_tp_rank``, ``dst_state_item_lens``, ...) and go to stock as given.
        """
        stock_args = (peer_name, prefill_state_indices, dst_state_data_ptrs, dst_state_indices, dst_gpu_id, notif,
                      decode_tp_size) + args
        src = [p for p, _ in _flatten_state(self.kv_args)]
        if not src:
            return super().maybe_send_extra(*stock_args, **kwargs)
        if not self.is_mla_backend and int(decode_tp_size) != self.attn_tp_size:
            sliced = self._ext_send_swa_slices(
                peer_name, prefill_state_indices, dst_state_data_ptrs, dst_state_indices, dst_gpu_id, notif,
                int(decode_tp_size), args, kwargs,
            )
            if sliced is not None:
                return sliced
        info = self.decode_kv_args_table.get(peer_name)
        dst = _flatten_ptrs(getattr(info, "dst_state_data_ptrs", [])) if info is not None else []
        with self._ext_kinds(peer_name, src, dst, "state"):
            return super().maybe_send_extra(*stock_args, **kwargs)

    def _ext_send_swa_slices(
        self, peer_name, src_indices, dst_ptrs, dst_indices, dst_gpu_id, notif, decode_tp_size, args, kwargs
    ):
        """SWA components of a room's state as head slices to a decode rank of another TP size.

        Stock (0.5.10.post1 nixl/conn.py:701-704, 0.5.11 :866-869, 0.5.12.post1
        :1545-1548) raises for non-MLA SWA/NSA state whenever the TP sizes differ,
        so a hybrid SWA model cannot run prefill TP != decode TP over NIXL. An
        SWA window cache is attention KV (``2 * layers`` buffers of pages, the
        same heads as the KV pool), so F4's head layout places it exactly as KV.
        Returns None, leaving the room to stock (and to stock's error for SWA),
        unless every component that carries indices is SWA: a model mixing SWA
        with another state kind keeps stock's behaviour. 0.5.10.post1-0.5.11
        carry one flat component (``kv_args.state_type``), 0.5.12.x one list per
        component (``kv_args.state_types``).
        """
        per_component = isinstance(getattr(self.kv_args, "state_types", None), (list, tuple))
        if per_component:
            kinds = [str(getattr(t, "value", t)).lower() for t in self.kv_args.state_types]
            carried = [k for i, k in enumerate(kinds) if i < len(src_indices) and len(src_indices[i])]
        else:
            kinds = carried = [str(getattr(self.kv_args, "state_type", "none")).lower()]
        if not carried or any(k != "swa" for k in carried):
            return None
        info = self.decode_kv_args_table[peer_name]
        decode_tp_rank = kwargs.get("decode_tp_rank", args[0] if args else getattr(info, "decode_tp_rank", 0))
        dst_lens = kwargs.get("dst_state_item_lens", args[1] if len(args) > 1 else None)
        if dst_lens is None:
            dst_lens = getattr(info, "dst_state_item_lens", None)
        handles = []
        for i, kind in enumerate(kinds):
            if kind != "swa":
                continue
            def pick(x, i=i):  # this component's entry (per component) or the flat list itself
                if x is None:
                    return []
                return (x[i] if i < len(x) else []) if per_component else x

            src_i, dst_i = [int(v) for v in pick(src_indices)], [int(v) for v in pick(dst_indices)]
            if not src_i:
                continue
            if len(src_i) != len(dst_i):
                raise RuntimeError(
                    f"State index length mismatch at component {i} (swa): prefill={len(src_i)}, dst={len(dst_i)}"
                )
            src_lens = list(pick(self.kv_args.state_item_lens))
            dst_len = list(pick(dst_lens)) if dst_lens is not None and len(dst_lens) else None
            handles.append(
                self._ext_post_head_slice(
                    peer_name, f"SWA state (component {i})", list(pick(self.kv_args.state_data_ptrs)),
                    list(pick(dst_ptrs)), int(src_lens[0]), int(dst_len[0]) if dst_len else None,
                    src_i, dst_i, dst_gpu_id, f"{notif}_{i}" if per_component else notif,
                    self.attn_tp_size, decode_tp_size, int(decode_tp_rank),
                )
            )
        return handles if per_component else (handles[0] if handles else None)

    def send_kvcache_slice(
        self,
        peer_name: str,
        prefill_kv_indices,
        dst_kv_ptrs: list,
        dst_kv_indices,
        dst_gpu_id: int,
        notif: str,
        prefill_tp_size: int,
        decode_tp_size: int,
        decode_tp_rank: int,
        dst_kv_item_len: int,
    ):
        """Write this rank's share of the decode rank's heads (see ``HeadLayout``).

        Contract: prefill only, non-MLA with decode TP != prefill attention TP.
        Called where ``send_kvcache`` would be: scheduler thread inside
        ``add_transfer_request`` up to 0.5.11, ``transfer_worker`` thread on
        0.5.12.x; 0.5.11+ skip it for an empty chunk. ``dst_kv_indices`` is the chunk's slice of decode's pages, never shorter
        than ``prefill_kv_indices``. Returns a posted handle (or a
        notification-only one); never writes outside those pages or heads.
        """
        return self._ext_post_head_slice(
            peer_name, "KV", self.kv_args.kv_data_ptrs, dst_kv_ptrs, self.kv_args.kv_item_lens[0], dst_kv_item_len,
            prefill_kv_indices, dst_kv_indices, dst_gpu_id, notif, prefill_tp_size, decode_tp_size, decode_tp_rank,
        )

    def _ext_post_head_slice(
        self, peer_name: str, what: str, src_ptrs, dst_ptrs, src_item_len: int, dst_item_len: Optional[int],
        src_pages, dst_pages, dst_gpu_id: int, notif: str, prefill_tp_size: int, decode_tp_size: int,
        decode_tp_rank: int,
    ):
        """Post this rank's heads of ``src_pages`` into ``dst_pages`` of a paged K/V pool pair
        (``2 * layers`` buffers: K of each layer, then V). ``dst_item_len`` None: decode's page
        size in bytes is derived from the head layout (0.5.10.post1 registers no state item
        lengths). Returns the posted handle or, for a rank that sends no heads (a replica) or
        no pages, a notification-only one: decode counts one notification per prefill rank."""
        layout = self._ext_layout(prefill_tp_size, decode_tp_size)
        head_slice = layout.head_slice(
            self.kv_args.engine_rank % prefill_tp_size, decode_tp_rank % decode_tp_size
        )
        src_pages = np.asarray(src_pages, dtype=np.int64)
        dst_pages = np.asarray(dst_pages, dtype=np.int64)
        if not head_slice.is_sender or src_pages.size == 0:
            # A replica (another prefill rank sends these heads) or nothing to
            # send: decode still counts this rank's notification.
            return self.agent.send_notif(peer_name, notif.encode("ascii"))
        src_k, src_v, dst_k, dst_v, n_layers = self.get_mha_kv_ptrs_with_pp(src_ptrs, dst_ptrs)
        rows = head_slice_rows(
            layout, head_slice, what,
            list(src_k[:n_layers]) + list(src_v[:n_layers]),
            list(dst_k[:n_layers]) + list(dst_v[:n_layers]),
            src_pages, dst_pages,
            page_size=self.kv_args.page_size, src_item_len=src_item_len, dst_item_len=dst_item_len,
        )
        src_kind = mem_kind.single_kind(src_ptrs, self._ext_local_kinds, f"prefill {what}")
        peer = self._ext_peer_kinds.get(peer_name, {})
        dst_kind = mem_kind.single_kind(dst_ptrs, peer, f"decode {what}") if peer else mem_kind.VRAM
        src_reqs, dst_reqs = transfer_requests(
            rows, mem_kind.device_id(src_kind, self.kv_args.gpu_id), mem_kind.device_id(dst_kind, dst_gpu_id)
        )
        agent = self.agent._agent
        src_descs = agent.get_xfer_descs(src_reqs, src_kind)
        dst_descs = agent.get_xfer_descs(dst_reqs, dst_kind)
        handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name, notif.encode("ascii"))
        if not handle:
            raise Exception(f"Failed to create sliced {what} transfer")
        # Posted through the manager's agent object, as stock posts (a wrapper there sees every post).
        if self.agent.transfer(handle) == "ERR":
            raise Exception(f"Failed to post sliced {what} transfer")
        return handle

    # -- failures ------------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last, chunk_id, *args, **kwargs):
        """Stock's request, but a room that cannot be served ends Failed instead of raising.

        Contract: prefill only, on the scheduler thread: ``NixlKVSender.send``
        (from ``send_kv_chunk``) calls it per chunk after the room left
        Bootstrapping; ``transfer_infos[room]`` was filled by the bootstrap
        thread. Up to 0.5.11 it posts the transfers itself and must return a
        list (the sender extends its handles with it); on 0.5.12.x stock only
        enqueues for ``transfer_worker`` and the sender ignores the result.
        Never raise into the scheduler and never wait for a transfer here.
        """
        if bootstrap_room in self._ext_failed_rooms:
            if is_last:
                self._ext_forget_room(bootstrap_room)
            return []
        peers = list(self.transfer_infos.get(bootstrap_room, {}).values())
        for req in peers:
            error = self._ext_peer_errors.get(req.agent_name) or self._ext_destination_error(req)
            if error is not None:
                self.record_failure(bootstrap_room, error)
                if is_last:
                    self._ext_forget_room(bootstrap_room)
                return []
        if is_last and peers:
            # Stock drops transfer_infos[room] after posting the last chunk (0.5.10.post1,
            # 0.5.11); a transfer that then fails (ERR, seen in the sender's poll) must still
            # reach decode, or decode waits out SGLang's waiting timeout (300 s by default).
            self._ext_posted_peers[bootstrap_room] = [req.agent_name for req in peers]
        try:
            return super().add_transfer_request(
                bootstrap_room, kv_indices, index_slice, is_last, chunk_id, *args, **kwargs
            )
        except Exception as exc:  # noqa: BLE001 - any failure must end the room, not the scheduler
            logger.error("nixl-ext: room %s failed: %s", bootstrap_room, exc)
            self.record_failure(bootstrap_room, f"{type(exc).__name__}: {exc}")
            if is_last:
                self._ext_forget_room(bootstrap_room)
            return []

    def _ext_forget_room(self, room: int) -> None:
        self.transfer_infos.pop(room, None)
        prefix = getattr(self, "req_to_decode_prefix_len", None)
        if isinstance(prefix, dict):
            prefix.pop(room, None)

    def record_failure(self, bootstrap_room: int, failure_reason: str):
        """Stock record; on prefill also poll Failed and tell decode once per room.

        Contract: SGLang calls it on prefill from the scheduler thread
        (``CommonKVSender.abort``; also its ``__init__`` from 0.5.11) and, on 0.5.12.x, from
        ``transfer_worker`` threads; on decode from the receiver's ``init``,
        ``poll`` and ``abort``; the plugin calls it too. Calls may race across
        threads and arrive with no lock held (stock guards its record with
        ``failure_lock``). Never raise: every caller is already a failure path.
        """
        super().record_failure(bootstrap_room, failure_reason)
        if not getattr(self, "_ext_is_prefill", False):
            quorum = getattr(self, "_ext_quorum", None)
            if quorum is not None:
                quorum.forget(bootstrap_room)
            return
        with self._ext_lock:
            self._ext_failed_rooms[bootstrap_room] = str(failure_reason)
            first = bootstrap_room not in self._ext_notified_rooms
            self._ext_notified_rooms.add(bootstrap_room)
        self.update_status(bootstrap_room, KVPoll.Failed)
        if first:
            self._ext_notify_failure(bootstrap_room, str(failure_reason))

    def _ext_notify_failure(self, room: int, reason: str) -> None:
        """Tell every decode rank of ``room`` that this prefill rank gave up on it."""
        tag = failure_tag(room, self._ext_pp_rank, self._ext_engine_rank, reason).encode("ascii")
        agents = [req.agent_name for req in list(self.transfer_infos.get(room, {}).values())]
        posted = self._ext_posted_peers.pop(room, None) or []
        for agent_name in agents + [a for a in posted if a not in agents]:
            try:
                self.agent._agent.send_notif(agent_name, tag)
            except Exception as exc:  # noqa: BLE001 - decode then ends by its own timeout
                logger.warning("nixl-ext: could not tell decode %s that room %s failed: %s", agent_name, room, exc)

    def _ext_gate_notifs(self, notifs: Dict[str, list]) -> Dict[str, list]:
        """Decode: ``notifs`` (agent name -> messages) with aux and failure notices gated by room.

        Called from ``ExtNixlAgent.get_new_notifs``, i.e. from stock's
        ``update_transfer_status`` on every receiver poll, so held failures past
        their grace are released here too. Every other message passes unchanged.
        """
        out: Dict[str, list] = {}
        released = []
        for peer, messages in notifs.items():
            for msg in messages:
                notice = parse_failure_tag(msg)
                if notice is not None:
                    released += self._ext_quorum.offer_failure(notice.room, peer, notice, self._ext_required(notice.room))
                    continue
                room = aux_room(msg)
                if room is not None:
                    released += self._ext_quorum.offer_aux(room, peer, msg, self._ext_required(room))
                    continue
                out.setdefault(peer, []).append(msg)
        released += self._ext_quorum.expired()
        for kind, peer, item in released:
            if kind == AUX:
                out.setdefault(peer, []).append(item)
            else:
                self._ext_on_failure_notice(peer, item)
        return out

    def _ext_required(self, room: int) -> int:
        """Prefill ranks that answer ``room`` on this decode rank (SGLang's own count; 1 if unknown)."""
        table = getattr(self, "required_prefill_response_num_table", None) or {}
        return int(table.get(room, 1) or 1)

    def _ext_on_failure_notice(self, peer: str, notice) -> None:
        """Decode: a prefill rank reported ``notice.room`` as failed."""
        statuses = getattr(self, "transfer_statuses", None)
        if statuses is None:
            return
        statuses[notice.room].is_failure = True
        super().record_failure(
            notice.room, f"prefill rank {notice.sender_id} ({peer}) failed the transfer: {notice.reason}"
        )

    def _ext_room_failure(self, room: int) -> Optional[str]:
        return self._ext_failed_rooms.get(room)


# --- registration frames --------------------------------------------------------------------

# Room field of a decode registration message (after the GUARD frame).
REGISTRATION_ROOM = b"None"


def _is_registration(frames) -> bool:
    return len(frames) > 1 and bytes(frames[1]) == REGISTRATION_ROOM


class NixlExtKVReceiver(NixlKVReceiver):
    """Stock receiver; its registration message carries decode's pool sizes too."""

    def _register_kv_args(self):
        """Stock registration, with one trailing pool-bounds frame.

        Contract: decode only, on the scheduler thread: ``CommonKVReceiver``
        calls it when a receiver first meets a prefill bootstrap address and
        stock sends one message per prefill rank through the cached socket
        (``_connect_to_bootstrap_server``). Stock's frames go out unchanged and
        in order (a stock prefill parses them by position and never reads past
        its own fields); the socket is wrapped for this call only.
        """
        frame = pool_bounds_frame(self.kv_mgr.kv_args, logger, state=False)
        if frame is None:
            return super()._register_kv_args()
        return register_appending(self, frame, _is_registration, super()._register_kv_args)


# --- sender -------------------------------------------------------------------------------


class NixlExtKVSender(NixlKVSender):
    """Stock sender; a room the manager failed polls as Failed, a NIXL error too, and a
    room still Bootstrapping after SGLang's bootstrap timeout too."""

    def _ext_bootstrap_expired(self, mgr) -> Optional[float]:
        """Seconds waited, once a room still Bootstrapping has waited SGLang's bootstrap
        timeout. Stock NIXL (0.5.10.post1-0.5.12.x) has no such deadline: a room whose decode
        died before sending its metadata stays Bootstrapping, its KV pinned, for ever."""
        timeout = getattr(mgr, "bootstrap_timeout", None)
        if timeout is None:
            return None
        # The clock starts at the first poll: the scheduler polls a sender on its next
        # pass after creating it (``pop_bootstrapped``). Not in ``__init__``: its
        # signature differs by release and callers inspect it.
        created = self.__dict__.setdefault("_ext_first_poll", time.time())
        elapsed = time.time() - created
        return elapsed if elapsed >= timeout else None

    def poll(self) -> KVPoll:
        """Contract: prefill scheduler thread, every pass of ``pop_bootstrapped``,
        ``process_disagg_prefill_inflight_queue`` and (PP) ``get_transferred_rids``,
        through ``poll_and_all_reduce``: the value is MIN-all-reduced over the
        attention TP/CP group, so each rank must return promptly and never raise
        (stock raises on an ERR handle up to 0.5.11), or the collective breaks.
        Never Success before the bytes landed: every handle DONE up to 0.5.11,
        the worker's Success on 0.5.12.x. A room still Bootstrapping after the
        manager's ``bootstrap_timeout`` (SGLang's setting) ends Failed, with the
        seconds in the reason, as Mooncake's sender does on these releases.
        """
        mgr = self.kv_mgr
        if isinstance(mgr, NixlExtKVManager) and mgr._ext_room_failure(self.bootstrap_room) is not None:
            return KVPoll.Failed
        try:
            status = super().poll()
        except Exception as exc:  # noqa: BLE001 - stock raises on an ERR transfer
            if not isinstance(mgr, NixlExtKVManager):
                raise
            mgr.record_failure(self.bootstrap_room, f"NIXL transfer error: {exc}")
            return KVPoll.Failed
        if status == KVPoll.Success and isinstance(mgr, NixlExtKVManager):
            mgr._ext_posted_peers.pop(self.bootstrap_room, None)
        if status == KVPoll.Bootstrapping and isinstance(mgr, NixlExtKVManager):
            elapsed = self._ext_bootstrap_expired(mgr)
            if elapsed is not None:
                mgr.record_failure(
                    self.bootstrap_room,
                    f"Request {self.bootstrap_room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping: "
                    "decode never sent this room's metadata (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
                )
                return KVPoll.Failed
        return status

    def failure_exception(self):
        """Contract: prefill scheduler thread, only after the all-reduced poll read
        Failed (possibly because another rank failed), inside SGLang's
        ``try/except Exception`` that appends the message to the abort reason.
        It is expected to raise; the room's recorded reason comes first.
        """
        mgr = self.kv_mgr
        reason = mgr._ext_room_failure(self.bootstrap_room) if isinstance(mgr, NixlExtKVManager) else None
        if reason is not None:
            raise RuntimeError(f"NIXL KVSender failed room {self.bootstrap_room}: {reason}")
        return super().failure_exception()


def ext_classes(policy: ReleasePolicy) -> Dict[str, type]:
    """Names in ``sglang.srt.disaggregation.nixl`` to route to the plugin.

    Where F11 is live (0.5.22, 0.5.23) that is ``backends.nixl.head_sliced``'s manager (with F22's
    transfer deadline, ``backends.nixl.transfer_deadline``), where F13 is (0.5.13-0.5.21)
    ``backends.nixl.swa_tp``'s (with F22's on 0.5.20 and 0.5.21); from 0.5.16 with F23's rooms
    decode ended first (``backends.common.ended_first``), from 0.5.20 with F24's rooms prefill dropped
    or never admitted (``backends.nixl.dropped_rooms``).
    The F4 classes serve 0.5.10.post1, 0.5.11 and 0.5.12.x: the release
    differences they meet (state-pointer layout, the method and field that
    build notification tags, the sender's failure path) are handled where
    they appear, by shape, not by version.
    """
    if not policy.routes("nixl"):
        return {}
    if policy.is_live("F11"):
        # 0.5.22, 0.5.23: F4 is upstream; only F11 is composed over stock's manager
        # (stock's sender reports the conclusions F11 makes).
        from sglang_disagg_ext.backends.nixl.head_sliced import NixlHeadSlicedKVManager

        manager = NixlHeadSlicedKVManager
        if policy.is_live("F22"):
            from sglang_disagg_ext.backends.nixl.transfer_deadline import with_transfer_deadline

            manager = with_transfer_deadline(manager)
        return {"NixlKVManager": _with_verification(_with_orphan_rooms(manager, policy), policy)}
    if policy.is_live("F13"):
        # 0.5.13-0.5.21: F4 is upstream; only F13's SWA head slices over stock's manager.
        from sglang_disagg_ext.backends.nixl.swa_tp import NixlSwaTpKVManager

        manager = NixlSwaTpKVManager
        if policy.is_live("F22"):  # 0.5.20, 0.5.21: the same _await_handles as 0.5.22+
            from sglang_disagg_ext.backends.nixl.transfer_deadline import with_transfer_deadline

            manager = with_transfer_deadline(manager)
        return {"NixlKVManager": _with_verification(_with_orphan_rooms(manager, policy), policy)}
    return {"NixlKVManager": _with_verification(NixlExtKVManager, policy, _F4StatePlacement),
            "NixlKVSender": NixlExtKVSender, "NixlKVReceiver": NixlExtKVReceiver}


class _F4StatePlacement:
    """Verified transfers over the F4 classes: where decode's registration lists no state item
    lengths (0.5.10.post1) and the TP sizes differ, decode's are derived as F4's head slices
    place SWA state (``_ext_post_head_slice``: a decode page holds its rank's heads at
    prefill's bytes per head), so a sliced state page is digested at decode's page size."""

    def _verify_dst_state_lens(self, info) -> List[List[int]]:
        lens = super()._verify_dst_state_lens(info)
        decode_tp = int(getattr(info, "decode_tp_size", 0) or 0)
        if lens or not decode_tp or decode_tp == self.attn_tp_size:
            return lens
        layout = self._ext_layout(self.attn_tp_size, decode_tp)
        own = self.kv_args.state_item_lens or []
        per_component = [list(v) for v in own] if own and isinstance(own[0], (list, tuple)) else [list(own)]
        return [[int(n) * layout.decode_heads_per_rank // layout.prefill_heads_per_rank for n in ns]
                for ns in per_component if ns]


def _with_orphan_rooms(manager: type, policy: ReleasePolicy) -> type:
    """F23 (0.5.16+, where prefill's bootstrap loop hands decode's ABORT to
    ``_handle_abort_notification``): ``backends.common.ended_first``; with F24 (0.5.20+, where decode
    also reads a Failed status from prefill) ``backends.nixl.dropped_rooms``, which includes it."""
    if policy.is_live("F24"):
        from sglang_disagg_ext.backends.nixl.dropped_rooms import with_dropped_rooms

        return with_dropped_rooms(manager)
    if not policy.is_live("F23"):
        return manager
    from sglang_disagg_ext.backends.common.ended_first import with_ended_first

    return with_ended_first(manager)


def _with_verification(cls: type, policy: ReleasePolicy, placement: Optional[type] = None) -> type:
    from sglang_disagg_ext import verification

    def mixin() -> type:
        from sglang_disagg_ext.backends.nixl.verify import NixlVerifiedTransferMixin

        if placement is None:
            return NixlVerifiedTransferMixin
        return type(f"{placement.__name__.lstrip('_')}VerifiedTransferMixin", (placement, NixlVerifiedTransferMixin),
                    {"__module__": __name__, "__doc__": NixlVerifiedTransferMixin.__doc__})

    return verification.with_verification(cls, "nixl-ext", policy, mixin, logger)
