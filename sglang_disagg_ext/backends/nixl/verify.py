"""Verified transfers for ``nixl-ext``: where NIXL's writes meet the digest.

SGLang's NIXL manager has no single write call like Mooncake's ``_transfer_data``:
it builds descriptor lists (``get_xfer_descs``, ``prep_xfer_dlist``, plain or
strided ``(addr, len, dev, stride, count)`` rows) and creates each transfer from
them (``make_prepped_xfer`` by index, ``initialize_xfer`` from two lists) for KV
pages, heterogeneous-TP head slices, state components and the aux row alike. So the
manager's ``agent`` is wrapped (:class:`RecordingAgent`, set through a property the
moment SGLang's constructor assigns it, so every later use goes through it): it
remembers what each descriptor list and prepared handle holds, and when a WRITE
transfer is created it hands the transfer's ``(src, dst, length)`` blocks and peer
agent to :meth:`.VerifiedTransferMixin._verify_add_blocks`, before the transfer
exists and so before the engine reads a byte. Everything else (placement, partials,
the status frame, decode's check) is :mod:`..common.verify`'s.

How the digest travels depends on how the decode learns a room's Success:

* from prefill's ``KV_STATUS`` message alone (0.5.23, probe
  ``nixl_success_via_listener_only``): a trailing status frame, as for Mooncake;
* from NIXL notifications alone (up to 0.5.22, probe ``nixl_success_via_notifications_only``:
  the F4 classes on 0.5.10.post1-0.5.12.x, F13's over stock's manager on 0.5.13-0.5.21, F11's on
  0.5.22; from 0.5.20 SGLang's common status codec exists, but NIXL's prefill sends only
  failures through it): on
  the room's aux notification. Prefill writes the aux row last in a room's last chunk (after its KV and
  state), so when that transfer is created every block of the room for that decode has
  been digested; the frame rides on the notification as one more ``_``-field
  (``_SDXV<rank>.<base64>``, ASCII without ``_``). Stock decodes of those releases split
  the tag on ``_`` and read at most the fields before it (``<room>_aux`` 2 fields,
  ``<room>_aux_nokv_<S>`` 4), so a stock decode is unaffected. The ``-ext`` decode takes
  the field off as the notifications arrive (before F4's quorum reads them) and checks the
  room in ``check_transfer_done`` when stock would conclude it, before it does; a mismatch
  moves the room to Failed, which the next poll reads. NIXL
  delivers a notification after its transfer's bytes landed, and the room is done only
  when every transfer's notification arrived. Prefill's reply address rides in the same
  field (``.<base64>`` after the digest) and decode tells it of a mismatch, as on 0.5.23;
  before 0.5.19 (``releases.stock_bootstrap_reads_notices``) stock's bootstrap loop takes no
  notices and ``_start_bootstrap_thread`` starts it on a socket filter that takes them.

Not covered (the room's pages are simply not listed, or the room goes unverified):
descriptor lists built from tensors (SGLang builds them from addresses), staging
(the destination is decode's staging ring, not a registered pool: unverified, see
``VerifiedTransferMixin._verify_peer``).
Head slices are digested byte by byte (``digest_kernels.span_digest``), slower than
whole pages.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.common.verify import VerifiedTransferMixin, logger, recorded_attribute
from sglang_disagg_ext.core import digest as dg

_DLIST_MEMORY = 256  # descriptor lists remembered between get_xfer_descs and their use
# The digest field of an aux notification: b"_" + NOTIF_DIGEST + b"<prefill rank>." + base64(frame).
NOTIF_DIGEST = b"SDXV"
_CHECKED_MEMORY = 4096  # decode rooms already checked (check_transfer_done may be asked again)
NOTIF_FRAME_GRACE_S = 1.0  # how long a concluded room waits for the other prefill ranks' digests


def descriptor_blocks(descs) -> Optional[np.ndarray]:
    """``(addr, len)`` rows (int64, one per block) of a descriptor list as SGLang hands it
    to NIXL: an ``N x 3`` ``(addr, len, dev)`` array or list of 3-tuples, or an ``N x 5``
    strided array ``(addr, len, dev, stride, count)`` (expanded in row order, as SGLang's
    own fallback ``_expand_stride_descs`` does). None for anything else (tensors)."""
    if isinstance(descs, (list, tuple)):
        if not descs:
            return np.empty((0, 2), dtype=np.int64)
        if not all(isinstance(d, (list, tuple)) and len(d) == 3 for d in descs):
            return None
        descs = np.array(descs, dtype=np.uint64)
    if not isinstance(descs, np.ndarray) or descs.ndim != 2 or descs.shape[1] not in (3, 5):
        return None
    rows = descs.astype(np.uint64, copy=False)
    if rows.shape[1] == 3:
        return rows[:, :2].astype(np.int64)
    counts = rows[:, 4].astype(np.int64)
    n = int(counts.sum())
    row = np.repeat(np.arange(rows.shape[0]), counts)
    k = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)  # block within its row
    out = np.empty((n, 2), dtype=np.int64)
    out[:, 0] = rows[row, 0].astype(np.int64) + k * rows[row, 3].astype(np.int64)
    out[:, 1] = rows[row, 1].astype(np.int64)
    return out


WriteSink = Callable[[str, Optional[np.ndarray], Optional[str]], None]
NotifSink = Callable[[str, bytes], bytes]


def aux_notif_room(tag) -> Optional[int]:
    """The room of a stock aux notification tag (``<room>_aux`` or ``<room>_aux_nokv_<S>``), else None."""
    if isinstance(tag, str):
        tag = tag.encode("ascii", "replace")
    if not isinstance(tag, (bytes, bytearray)):
        return None
    fields = bytes(tag).split(b"_")
    if len(fields) >= 2 and fields[1] == b"aux" and fields[0].isdigit():
        return int(fields[0])
    return None


def with_digest(tag, rank: int, frame: bytes, reply: Optional[bytes] = None):
    """``tag`` (str or bytes, same type back) with the digest field appended:
    ``_SDXV<rank>.<base64 frame>``, and ``.<base64 reply>`` where prefill can hear a notice."""
    field = b"_" + NOTIF_DIGEST + str(int(rank)).encode("ascii") + b"." + base64.b64encode(frame)
    if reply:
        field += b"." + base64.b64encode(reply)
    if isinstance(tag, str):
        return tag + field.decode("ascii")
    return bytes(tag) + field


def split_digest(msg: bytes):
    """``(tag, rank, frame, reply)`` of a notification with a digest field (``reply`` None where
    it carries none), ``(msg, None, None, None)`` without one; a field that cannot be read gives
    ``(tag, None, None, None)`` (the tag is stock's either way)."""
    i = msg.find(b"_" + NOTIF_DIGEST)
    if i < 0:
        return msg, None, None, None
    tag, field = msg[:i], msg[i + 1 + len(NOTIF_DIGEST):]
    rank, dot, payload = field.partition(b".")
    payload, _, reply = payload.partition(b".")
    try:
        if not dot or not rank.isdigit():
            raise ValueError("no rank")
        return (tag, int(rank), base64.b64decode(payload, validate=True),
                base64.b64decode(reply, validate=True) if reply else None)
    except ValueError:
        return tag, None, None, None


class RecordingAgent:
    """A ``nixl_agent`` whose WRITE transfers are reported to ``on_write(peer, blocks, why)``
    before they are created (``blocks``: ``N x 3`` int64 ``(src, dst, length)``; ``why`` when
    they cannot be known). Every other attribute is the agent's own; results are the agent's."""

    _verify_wrapped = True

    def __init__(self, agent, on_write: WriteSink, on_notif: Optional[NotifSink] = None,
                 on_notifs: Optional[Callable[[dict], dict]] = None):
        self._agent = agent
        self._on_write = on_write
        # Prefill: (peer, notification tag) -> the tag to send (the digest appended).
        self._on_notif = on_notif
        # Decode: NIXL's new notifications -> the ones stock reads (digest fields taken off).
        self._on_notifs = on_notifs
        self._lock = threading.Lock()
        self._dlists: "OrderedDict[int, tuple]" = OrderedDict()  # id -> (dlist, blocks)
        self._prepped = {}  # id(handle) -> (handle, peer, blocks)

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def get_xfer_descs(self, descs, *args, **kwargs):
        dlist = self._agent.get_xfer_descs(descs, *args, **kwargs)
        with self._lock:
            self._dlists[id(dlist)] = (dlist, descriptor_blocks(descs))
            while len(self._dlists) > _DLIST_MEMORY:
                self._dlists.popitem(last=False)
        return dlist

    def _blocks_of(self, descs) -> Optional[np.ndarray]:
        with self._lock:
            hit = self._dlists.get(id(descs))
        if hit is not None and hit[0] is descs:
            return hit[1]
        return descriptor_blocks(descs)

    def prep_xfer_dlist(self, agent_name, xfer_list, *args, **kwargs):
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs)
        blocks = self._blocks_of(xfer_list)
        with self._lock:
            self._prepped[id(handle)] = (handle, agent_name, blocks)
        return handle

    def release_dlist_handle(self, handle, *args, **kwargs):
        with self._lock:
            self._prepped.pop(id(handle), None)
        return self._agent.release_dlist_handle(handle, *args, **kwargs)

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          *args, **kwargs):
        if operation == "WRITE":
            with self._lock:
                local = self._prepped.get(id(local_xfer_side))
                remote = self._prepped.get(id(remote_xfer_side))
            if remote is None or remote[0] is not remote_xfer_side:
                self._on_write("", None, "a prepared remote list the verifier did not see")
            elif local is None or local[0] is not local_xfer_side:
                self._on_write(remote[1], None, "a prepared local list the verifier did not see")
            else:
                self._report(remote[1], local[2], remote[2], local_indices, remote_indices)
                args, kwargs = self._with_notif(remote[1], args, kwargs)
        return self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices, remote_xfer_side,
                                             remote_indices, *args, **kwargs)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, *args, **kwargs):
        if operation == "WRITE":
            self._report(remote_agent, self._blocks_of(local_descs), self._blocks_of(remote_descs), None, None)
            args, kwargs = self._with_notif(remote_agent, args, kwargs)
        return self._agent.initialize_xfer(operation, local_descs, remote_descs, remote_agent, *args, **kwargs)

    def _with_notif(self, peer: str, args: tuple, kwargs: dict):
        """The transfer's notification (``notif_msg``: first extra argument or keyword) as
        ``on_notif`` rewrites it; after ``_report``, so the transfer's own blocks are in."""
        if self._on_notif is None:
            return args, kwargs
        if "notif_msg" in kwargs:
            kwargs = dict(kwargs, notif_msg=self._on_notif(peer, kwargs["notif_msg"]))
        elif args:
            args = (self._on_notif(peer, args[0]),) + tuple(args[1:])
        return args, kwargs

    def get_new_notifs(self, *args, **kwargs):
        notifs = self._agent.get_new_notifs(*args, **kwargs)
        if self._on_notifs is None or not notifs:
            return notifs
        return self._on_notifs(notifs)

    def _report(self, peer, src, dst, src_index, dst_index) -> None:
        if src is None or dst is None:
            self._on_write(peer, None, "a descriptor list the verifier cannot read")
            return
        if src_index is not None:
            src = src[np.asarray(src_index, dtype=np.int64)]
            dst = dst[np.asarray(dst_index, dtype=np.int64)]
        if src.shape[0] != dst.shape[0] or (src[:, 1] != dst[:, 1]).any():
            self._on_write(peer, None, f"{src.shape[0]} source and {dst.shape[0]} destination descriptors differ")
            return
        self._on_write(peer, np.column_stack((src[:, 0], dst[:, 0], src[:, 1])), None)


class NixlVerifiedTransferMixin(VerifiedTransferMixin):
    """NIXL's entry: the blocks of each WRITE transfer the manager creates (see the module)."""

    agent = recorded_attribute(
        "_verify_nixl_agent", lambda self, agent: RecordingAgent(
            agent, self._verify_nixl_write,
            self._verify_notif_digest if self._verify_via_notifs() else None,
            self._verify_take_notif_digests if self._verify_via_notifs() else None),
        """The manager's NIXL agent; with verification on, wrapped in :class:`RecordingAgent`.

        Contract: SGLang's constructor assigns ``self.agent`` once (both sides) and every
        thread uses it afterwards; the wrapper changes no argument or result, except, where
        the decode concludes from notifications, an aux notification's digest field (added
        on prefill, taken off on decode before stock or F4's quorum read it).""")

    def _verify_via_notifs(self) -> bool:
        """Whether the digest rides on the aux notification (see the module): a decode that
        also concludes Success from NIXL notifications."""
        cached = self.__dict__.get("_verify_notifs_path")
        if cached is None:
            cached = self.__dict__["_verify_notifs_path"] = releases.features().nixl_success_via_notifications_only
        return cached

    # -- prefill ----------------------------------------------------------------------
    def _start_bootstrap_thread(self, *args, **kwargs):
        """Stock's bootstrap thread, reading through a filter that takes decode's mismatch
        notices where stock's loop does not (before 0.5.19; see
        :meth:`.VerifiedTransferMixin._verify_listen_for_notices`).

        Contract: prefill only, called once from stock's constructor after ``server_socket``
        is bound; the loop it starts reads ``self.server_socket`` for every message. Every
        other message reaches it unchanged.
        """
        self._verify_listen_for_notices()
        return super()._start_bootstrap_thread(*args, **kwargs)

    def _verify_notif_digest(self, peer: str, tag):
        """Prefill, as a WRITE transfer to ``peer`` is created with notification ``tag``: for
        a room's aux notification, the tag with that room's digest for ``peer`` appended.
        Must never raise (the transfer would not be created): on any error the tag goes as is
        and the room is unverified on decode."""
        if self.disaggregation_mode.name != "PREFILL":
            return tag
        try:
            room = aux_notif_room(tag)
            if room is None:
                return tag
            with self._verify_lock:
                partial = self._verify_partials.pop((room, peer), None)
            if partial is None or partial.unverifiable(room, peer):
                return tag
            frame = dg.encode_frame(partial.digests, partial.pages)
            # Prefill's reply address rides along where its bootstrap loop takes decode's notices.
            return with_digest(tag, int(getattr(self.kv_args, "engine_rank", 0) or 0), frame,
                               self._verify_reply_frame())
        except Exception:  # noqa: BLE001 - verification must never fail a transfer by itself
            logger.exception("verified transfers: could not add the digest to a NIXL notification")
            return tag

    def record_failure(self, bootstrap_room, failure_reason):
        """Stock record; the room's digests are dropped (prefill: no aux notification will
        carry them; decode: the room will not be checked).

        Contract: as the wrapped ``record_failure`` (any thread, both sides, never raises)."""
        super().record_failure(bootstrap_room, failure_reason)
        if self._verify_on:
            with self._verify_lock:
                for key in [k for k in self._verify_partials if k[0] == bootstrap_room]:
                    del self._verify_partials[key]
                self._verify_frames.pop(bootstrap_room, None)
                self._verify_replies.pop(bootstrap_room, None)
            self.__dict__.get("_verify_frame_wait", {}).pop(bootstrap_room, None)

    # -- decode, notification path --------------------------------------------------
    def _verify_await_frames(self, room: int) -> bool:
        """Whether to hold a room stock would conclude until every prefill rank's digest came.

        Stock counts one aux notification per room however many prefill ranks write the aux
        row (0.5.13-0.5.19: ``received_aux``), so across TP sizes it may conclude on the first
        rank's; the others' (with their digests) follow within moments. A room for which at
        least one digest arrived waits for the rest up to ``NOTIF_FRAME_GRACE_S``, then is
        checked with what came (fewer frames than ranks: unverified, never a false alarm). A
        room with no digest at all (a stock prefill) is not held."""
        expected = int(self.required_prefill_response_num_table.get(room, 1) or 1)
        with self._verify_lock:
            have = len(self._verify_frames.get(room, {}))
        waiting = self.__dict__.setdefault("_verify_frame_wait", {})
        if have == 0 or have >= expected:
            waiting.pop(room, None)
            return False
        first = waiting.setdefault(room, time.monotonic())
        if time.monotonic() - first < NOTIF_FRAME_GRACE_S:
            return True
        waiting.pop(room, None)
        return False

    def _verify_take_notif_digests(self, notifs: dict) -> dict:
        """Decode (scheduler thread, each receiver poll): NIXL's new notifications with every
        digest field taken off, each frame kept for its room and prefill rank. Never raises."""
        if self.disaggregation_mode.name != "DECODE":
            return notifs
        out: Dict[str, List[bytes]] = {}
        for peer, messages in notifs.items():
            kept = out[peer] = []
            for msg in messages:
                try:
                    tag, rank, frame, reply = split_digest(bytes(msg))
                    if frame is not None:
                        room = aux_notif_room(tag)
                        if room is not None:
                            self._verify_keep_frame(room, rank, frame)
                            if reply is not None:
                                self._verify_keep_reply(room, rank, reply)
                    kept.append(tag)
                except Exception:  # noqa: BLE001 - the notification reaches stock as it came
                    logger.exception("verified transfers: unreadable digest field in a NIXL notification")
                    kept.append(msg)
        return out

    def check_transfer_done(self, room: int):
        """Stock's answer; where it is "done", the room is verified first.

        Contract: decode scheduler thread, from ``NixlKVReceiver.poll`` right after
        ``update_transfer_status`` (every aux and KV notification of the room arrived, so
        its bytes landed), after ``poll`` read ``check_status``; on True stock concludes
        the room (Success, or Failed where its ``TransferStatus`` says so). A digest
        mismatch records the reason, moves the room to Failed and answers "not done": the
        next ``poll`` reads Failed from ``check_status``, as for any recorded failure.
        Must not raise.
        """
        done = super().check_transfer_done(room)
        if not (done and self._verify_on and self._verify_via_notifs()):
            return done
        if self.disaggregation_mode.name != "DECODE":
            return done
        try:
            status = self.transfer_statuses.get(room)
            # Insertion-ordered and bounded: membership in O(1), the oldest room dropped first.
            checked = self.__dict__.setdefault("_verify_checked", OrderedDict())
            if status is None or bool(getattr(status, "is_failure", False)) or room in checked:
                return done
            if self._verify_await_frames(room):
                return False
            checked[room] = None
            if len(checked) > _CHECKED_MEMORY:
                checked.popitem(last=False)
            with self._verify_lock:
                frames = self._verify_frames.pop(room, None)
                replies = self._verify_replies.pop(room, None)
            reason = self._verify_check(room, frames)
            if reason is not None:
                logger.error("room %s: %s", room, reason)
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)
                self._verify_tell_prefill(room, reason, replies or {})
                return False
        except Exception:  # noqa: BLE001 - the room concludes as stock says
            logger.exception("verified transfers: check of room %s failed to run", room)
        return done

    def _verify_nixl_write(self, peer: str, blocks: Optional[np.ndarray], why: Optional[str]) -> None:
        """One WRITE transfer about to be created (transfer worker thread, prefill). Must
        never raise: a digest that cannot be taken leaves the room unverified."""
        if self.disaggregation_mode.name != "PREFILL":
            return
        if blocks is not None:
            self._verify_write(peer, lambda: blocks, "a NIXL transfer")
        elif peer:
            self._verify_mark_unplaced(peer, why or "unknown blocks")
        else:  # the decode is unknown: no digest for any of the room's
            room = getattr(self._verify_tls, "room", None)
            for session in list(self.transfer_infos.get(room, {}) or {}) if room is not None else ():
                self._verify_mark_unplaced(session, why or "unknown blocks")
