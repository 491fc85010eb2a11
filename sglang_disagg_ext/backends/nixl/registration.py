"""``nixl-ext`` prefill: a decode whose registration cannot be served is refused, not fatal.

Shared by F11's class (0.5.22, 0.5.23: :mod:`.head_sliced`) and F13's
(0.5.13-0.5.21: :mod:`.swa_tp`). In every release 0.5.13-0.5.23 stock
NIXL's prefill bootstrap thread registers each decode rank by calling
``_add_remote_peer`` from its one receive loop (0.5.13 nixl/conn.py:1857,
0.5.21 :3057, 0.5.23 :3415-3426), with no handler around it (0.5.21-0.5.23
wrap the loop only to log and re-raise). One exception while registering one
decode rank (NIXL metadata, memory kinds, a head layout stock asserts on)
ends the thread: no later registration or room message of *any* decode is
read, and every room waits out SGLang's timeouts.

Here, on prefill:

* ``_add_remote_peer`` runs the pair check (:meth:`_check_pair`: can every
  head-sliced buffer, KV and SWA state, be cut for this decode's TP size?) and
  then stock's registration.
  A check that refuses, or any exception stock raises, refuses that decode
  rank with one error naming it and the reason (an exception is logged with
  its traceback and counted in
  ``thread_recoveries_total{role="prefill",thread="bootstrap"}``); the
  thread goes on.
* A refused decode's rooms end Failed on prefill at once: when the bootstrap
  thread marks such a room ready (``update_status(WaitingForInput)``) it is
  concluded Failed instead, and a room that became ready before prefill
  created it is failed when the scheduler sends its first chunk
  (``add_transfer_request``). Decode is told through SGLang's own status
  message where the release has one (``conclude_failure``, 0.5.20+).
* Up to 0.5.19 no NIXL message tells decode of a failure (decode learns only
  Success, from NIXL notifications; any prefill-side failure there, a refused
  decode's room or a transfer worker's exception alike, is ended on decode by
  its waiting timeout, 300 s by default). Here prefill sends one
  ``SGLANG_DISAGG_EXT_FAILED`` message (room, reason) to each decode rank of a
  room it fails (``update_status(Failed)``, with the reason stock or this
  class recorded), on its own PUSH socket to the endpoint that rank gave in its
  room message (decode's manager socket, which stock uses there only for
  staging requests and abort acks), without blocking. An ``-ext`` decode reads
  it off that socket before stock's reader sees it (or reads the socket
  itself where stock starts no reader: 0.5.13-0.5.18 without the staging
  buffer, 0.5.19 without staging or deferred release) and ends the room Failed
  with prefill's reason. A stock decode logs one "unexpected message tag"
  warning where it reads that socket, and otherwise waits out its timeout as
  before.
* Up to 0.5.15 stock's prefill bootstrap loop asserts that every message
  starts with its guard, and decode's abort of any request sends a bare
  ``ABORT`` message there (0.5.13 common/conn.py:1114-1126): the thread dies
  ("Foreign traffic?") and nothing after is served. Here the loop reads
  through a filter that handles the abort as 0.5.16 does and never hands it on.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Optional, Tuple

import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.core.head_slice import HeadLayoutError, check_head_sliced_pair, resolve_total_kv_heads
from sglang_disagg_ext.core.state_plan import state_kind_name
from sglang_disagg_ext.backends.common.shared import FilteringSocket
from sglang_disagg_ext.core.thread_survival import root_cause

logger = logging.getLogger("sglang_disagg_ext.nixl")

# Prefill -> decode, up to 0.5.19: [FAILED_TAG, room (ascii), reason (utf-8)].
FAILED_TAG = b"SGLANG_DISAGG_EXT_FAILED"


class RegistrationRefusalMixin:
    """Refuses, instead of dying on, a decode registration it cannot serve; see the module docstring."""

    # The fix the refusals are counted under (requests_refused_total{fix=...}).
    refusal_fix = "F11"

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup. The stock constructor starts prefill's bootstrap thread,
        which calls ``_add_remote_peer`` and ``update_status``: every field they read
        is set before ``super().__init__``.
        """
        self._refused_lock = threading.Lock()
        # decode agent name -> (its TP rank, why it cannot be served), refused at registration
        self._refused: Dict[str, Tuple[int, str]] = {}
        # Up to 0.5.19 (no conclude_failure): prefill's sockets to decode endpoints, used under
        # the lock (the bootstrap thread and the scheduler may both fail rooms).
        self._tell_lock = threading.Lock()
        self._tell_sockets: Dict[str, zmq.Socket] = {}
        # decode: whether stock started a reader of the manager socket (then it reads through ours).
        self._stock_reads_server_socket = False
        super().__init__(*args, **kwargs)
        if self._decode_reads_failures():
            self._wrap_server_socket()
            if not self._stock_reads_server_socket:
                threading.Thread(target=self._failure_reader, name="nixl-ext-failure-reader", daemon=True).start()

    # -- registration (bootstrap thread) -------------------------------------------------
    def _add_remote_peer(self, decode_kv_args):
        """Stock registration, after the class's pair check; never raises.

        Contract: stock ``bootstrap_thread`` calls it on prefill for every
        registration message (room ``None``) of a decode rank, parsed by
        ``KVArgsRegisterInfo.from_zmq``; an agent name already in
        ``decode_kv_args_table`` is ignored by stock. It runs on the one
        bootstrap thread that also serves every other decode's messages, so it
        must not raise (stock's raise ends that thread) and must not block.
        """
        name = decode_kv_args.agent_name
        if self.disaggregation_mode != DisaggregationMode.PREFILL or name in self.decode_kv_args_table:
            return super()._add_remote_peer(decode_kv_args)
        rank = getattr(decode_kv_args, "decode_tp_rank", -1)
        try:
            rank = int(rank)
            self._check_pair(decode_kv_args)
        except HeadLayoutError as exc:
            self._refuse(name, rank, f"decode TP rank {rank} refused at registration: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 - a bug in the check must not end the thread either
            self._registration_raised(name, rank, exc)
            return None
        try:
            return super()._add_remote_peer(decode_kv_args)
        except Exception as exc:  # noqa: BLE001 - keep the bootstrap thread alive; refuse this decode
            self._registration_raised(name, rank, exc)
            return None

    def _check_pair(self, info) -> None:
        """Raise HeadLayoutError where a head-sliced transfer to this decode cannot be cut.

        Runs on the bootstrap thread for a new decode rank's registration, before
        stock's. Heads are sliced only for a non-MLA model whose attention TP sizes
        differ (and, where the release checks decode context parallelism, 0.5.19+,
        no relayout is asked for): then KV (stock slices every KV region with the first item
        length: 0.5.16 nixl/conn.py:744-755, 0.5.23 :1305-1312) and every SWA state
        component (sliced with the model's KV head count: F13's class on
        0.5.13-0.5.21, common/conn.py:1809-1832 on 0.5.22+) must hold whole heads of
        one size on both sides. A decode that published no state item lengths is
        checked on KV only (its state has nothing to compare against here).
        """
        decode_tp = int(info.decode_tp_size)
        if (
            self.is_mla_backend
            or getattr(self, "is_hybrid_mla_backend", False)
            or decode_tp == self.attn_tp_size
            or (releases.features().dcp_relayout_check
                and self.requires_dcp_relayout(info.dst_dcp_size, info.dst_dcp_rank))
        ):
            return  # whole pages are sent: no head slice
        kv_args = self.kv_args
        heads = resolve_total_kv_heads(
            getattr(kv_args, "total_kv_head_num", None), kv_args.kv_head_num, self.attn_tp_size
        )
        page = kv_args.page_size
        check_head_sliced_pair(
            "KV", self.attn_tp_size, decode_tp, heads, page, [(kv_args.kv_item_lens[0], info.dst_kv_item_len)]
        )
        dst_state_lens = getattr(info, "dst_state_item_lens", None) or []
        if not dst_state_lens:
            return
        for i, st in enumerate(getattr(kv_args, "state_types", None) or []):
            if state_kind_name(st) != "swa" or i >= len(kv_args.state_item_lens):
                continue
            src = list(kv_args.state_item_lens[i] or [])
            dst = list(dst_state_lens[i] or []) if i < len(dst_state_lens) else []
            if len(src) != len(dst):
                raise HeadLayoutError(
                    f"SWA state (component {i}) cannot be head-sliced from prefill TP {self.attn_tp_size} "
                    f"to decode TP {decode_tp}: prefill has {len(src)} buffers, decode {len(dst)}"
                )
            check_head_sliced_pair(f"SWA state (component {i})", self.attn_tp_size, decode_tp, heads, page,
                                   list(zip(src, dst)))

    def _registration_raised(self, name: str, rank, exc: BaseException) -> None:
        root = root_cause(exc)
        logger.exception("nixl-ext: registering decode %s (TP rank %s) raised; refusing it, the bootstrap "
                         "thread keeps serving", name, rank)
        metrics.count("thread_recoveries_total", role="prefill", thread="bootstrap")
        self._refuse(name, rank, f"decode TP rank {rank} refused: its registration raised {type(root).__name__}: {root}")

    def _refuse(self, name: str, rank, reason: str) -> None:
        rank = rank if isinstance(rank, int) else -1  # the sort key of _room_refusal
        with self._refused_lock:
            self._refused[name] = (rank, reason)
        logger.error("nixl-ext: decode %s: %s", name, reason)

    def _room_refusal(self, room: int) -> Optional[str]:
        """The refusal of the lowest refused decode rank this room sends to (None: none refused)."""
        if not self._refused:
            return None
        # Snapshot: the bootstrap thread may add a late peer while we walk it.
        refusals = [
            self._refused[info.agent_name]
            for info in list((self.transfer_infos.get(room) or {}).values())
            if not _is_dummy(info) and info.agent_name in self._refused
        ]
        # The lowest rank's, so both sides of every room name the same one.
        return min(refusals)[1] if refusals else None

    def _fail_room(self, room: int, reason: str) -> None:
        metrics.count("requests_refused_total", fix=self.refusal_fix, reason="decode refused at registration")
        if releases.features().nixl_conclude_failure:
            # SGLang's own conclusion: records the reason, marks the room Failed and
            # sends Failed with the reason to every decode rank of the room.
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return
        # Up to 0.5.19: what a failure on prefill does there; update_status then tells decode.
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    # -- telling decode of a refused room, up to 0.5.19 ----------------------------------
    def _tell_decode_failed(self, room: int, reason: str) -> None:
        """Send (room, reason) to every decode rank of the room; never raises, never blocks."""
        frames = [FAILED_TAG, str(room).encode("ascii"), reason.encode("utf-8")]
        for info in list((self.transfer_infos.get(room) or {}).values()):
            try:
                address = NetworkAddress(info.endpoint, int(info.dst_port))
                with self._tell_lock:
                    sock = self._tell_sockets.get(address.to_tcp())
                    if sock is None:
                        sock = zmq.Context.instance().socket(zmq.PUSH)  # 0.5.13's manager keeps no context
                        sock.setsockopt(zmq.LINGER, 0)
                        if address.is_ipv6:
                            sock.setsockopt(zmq.IPV6, 1)
                        sock.connect(address.to_tcp())
                        self._tell_sockets[address.to_tcp()] = sock
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("nixl-ext: decode %s:%s does not take the failure of room %s now; it ends the "
                               "room by its waiting timeout", info.endpoint, info.dst_port, room)
            except Exception:  # noqa: BLE001 - telling decode is best effort; never end the caller's thread
                logger.exception("nixl-ext: could not tell decode %s:%s of the failure of room %s",
                                 getattr(info, "endpoint", "?"), getattr(info, "dst_port", "?"), room)

    def _prefill_tells_decode(self) -> bool:
        return (self.disaggregation_mode == DisaggregationMode.PREFILL
                and not releases.features().nixl_conclude_failure)

    def _decode_reads_failures(self) -> bool:
        return (self.disaggregation_mode == DisaggregationMode.DECODE
                and not releases.features().nixl_conclude_failure)

    def _wrap_server_socket(self) -> None:
        if not isinstance(self.server_socket, FilteringSocket):
            self.server_socket = FilteringSocket(self.server_socket, self._on_decode_message, logger)

    def _on_decode_message(self, msg):
        if not msg or msg[0] != FAILED_TAG:
            return None
        room, reason = int(msg[1].decode("ascii")), msg[2].decode("utf-8", "replace")
        # Only a room this decode still holds; Failed is sticky, Success is final.
        if self.request_status.get(room) not in (None, KVPoll.Success, KVPoll.Failed):
            logger.error("nixl-ext: prefill failed room %s: %s", room, reason)
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
        return FilteringSocket.CONSUMED

    def _failure_reader(self) -> None:
        """Decode's reader of the manager socket where stock starts none (up to 0.5.19)."""
        while True:
            try:
                msg = self.server_socket.recv_multipart()
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - keep reading; one bad message must not end the thread
                logger.exception("nixl-ext: decode failure reader")
                continue
            logger.warning("nixl-ext: decode manager socket: unexpected message tag %s", msg[0][:20] if msg else b"")

    # -- decode aborts on prefill, up to 0.5.15 ----------------------------------------------
    def _start_bootstrap_thread(self, *args, **kwargs):
        """Stock's bootstrap thread, reading through a filter that takes decode's ``ABORT``
        messages off where stock's loop would assert on them (up to 0.5.15).

        Contract: prefill only, called once from stock's constructor; the thread it starts
        reads ``self.server_socket`` in a loop. Up to 0.5.15 that loop asserts every
        message starts with its guard, and decode's abort of any request sends
        ``[b"ABORT", room, ...]`` there: the thread dies and no later registration or room
        is served (``releases.features().nixl_bootstrap_handles_abort``). Here the abort is
        handled as 0.5.16 handles it (the room, unless already Success, recorded and
        Failed) and never reaches stock's loop.
        """
        if self.disaggregation_mode == DisaggregationMode.PREFILL and not releases.features().nixl_bootstrap_handles_abort:
            self.server_socket = FilteringSocket(self.server_socket, self._on_prefill_message, logger)
        return super()._start_bootstrap_thread(*args, **kwargs)

    def _on_prefill_message(self, msg):
        if not msg or msg[0] != b"ABORT":
            return None
        try:
            room = int(msg[1].decode("ascii"))
        except (IndexError, ValueError, UnicodeDecodeError):
            logger.warning("nixl-ext: ignoring a malformed abort message (%d frames)", len(msg))
            return FilteringSocket.CONSUMED
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)
        return FilteringSocket.CONSUMED

    def _start_decode_staging_thread(self, *args, **kwargs):
        """Stock's reader of decode's manager socket (0.5.13-0.5.18), reading through ours.

        Contract: decode only, called once from stock's constructor when the staging
        buffer is on; the thread it starts reads ``self.server_socket`` in a loop.
        Wrapping it first lets prefill's failure messages be taken off before stock
        sees them, with one reader of the socket (ZMQ sockets are single-threaded).
        """
        if self._decode_reads_failures():
            self._wrap_server_socket()
            self._stock_reads_server_socket = True
        return super()._start_decode_staging_thread(*args, **kwargs)

    def _start_decode_listener_thread(self, *args, **kwargs):
        """Stock's reader of decode's manager socket (0.5.19+), reading through ours up to 0.5.19.

        Contract: decode only, called once from stock's constructor (0.5.19: with the
        staging buffer or deferred release, nixl/conn.py:520-521; from 0.5.20 this class
        changes nothing here: ``conclude_failure`` tells decode). See
        :meth:`_start_decode_staging_thread`.
        """
        if self._decode_reads_failures():
            self._wrap_server_socket()
            self._stock_reads_server_socket = True
        return super()._start_decode_listener_thread(*args, **kwargs)

    # -- rooms ---------------------------------------------------------------------------
    def update_status(self, bootstrap_room: int, status: KVPoll):
        """Stock, except that a ready room of a refused decode concludes Failed instead,
        and, up to 0.5.19, a room prefill fails is reported to its decode ranks.

        Contract: called from every thread of the manager (scheduler: sender
        init/abort; bootstrap thread: a room's decode infos are complete ->
        ``WaitingForInput``; transfer workers: progress and conclusions, a
        failure after ``record_failure`` with its reason). Changed: that
        bootstrap-thread case, only for a room already created by its sender
        (stock refuses to resurrect a room it has not seen); and on prefill up to
        0.5.19 the first Failed of a room, which is then sent to decode with the
        recorded reason (stock's only Failed path there that decode never hears
        of: a transfer worker's exception, a refusal, an abort). It must not
        raise or block.
        """
        if (
            status == KVPoll.WaitingForInput
            and self._refused
            and bootstrap_room in self.request_status
            and self.request_status.get(bootstrap_room) != KVPoll.Failed
        ):
            reason = self._room_refusal(bootstrap_room)
            if reason is not None:
                self._fail_room(bootstrap_room, reason)
                return None
        if status == KVPoll.Failed and self._prefill_tells_decode() and self.request_status.get(
            bootstrap_room
        ) not in (None, KVPoll.Failed):
            out = super().update_status(bootstrap_room, status)
            with self.failure_lock:
                reason = self.failure_records.get(bootstrap_room)
            self._tell_decode_failed(bootstrap_room, reason or "prefill failed the transfer (no reason recorded)")
            return out
        return super().update_status(bootstrap_room, status)

    def add_transfer_request(self, bootstrap_room: int, *args, **kwargs):
        """Stock, but a room of a refused decode concludes Failed instead of being queued.

        Contract: prefill scheduler thread, ``NixlKVSender.send`` per chunk. The
        room reaches it only when it became ready before its sender existed
        (``update_status`` could not fail it then). Stock would queue the chunk
        for a transfer worker, which asserts the decode is registered. Never raise.
        """
        reason = self._room_refusal(bootstrap_room)
        if reason is not None:
            if self.request_status.get(bootstrap_room) != KVPoll.Failed:
                self._fail_room(bootstrap_room, reason)
            return None
        return super().add_transfer_request(bootstrap_room, *args, **kwargs)


def _is_dummy(info) -> bool:
    """Whether a room's decode rank receives nothing (a method up to 0.5.19, a field after)."""
    if releases.features().nixl_is_dummy_method:
        return bool(info.is_dummy())
    return bool(getattr(info, "is_dummy", False))
