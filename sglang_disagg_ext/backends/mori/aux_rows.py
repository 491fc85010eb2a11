"""F12's metadata-row checks for ``mori-ext``, shared by F12's manager (:mod:`.metadata_order`,
every release but 0.5.12.x) and F3's (:mod:`.mori`, 0.5.12.x), where F12 is live on every release.

Stock MoRI's decode writes each metadata row it receives at the row's index
with the row's own length (``AuxDataCodec.deserialize_data_to_buffer``) and
drops, with one log line, a row whose bytes disagree with their declared
length (0.5.10.post1 mori/conn.py:774, 0.5.12.post1 :1122, 0.5.23 :1980): a
row of another size than decode's is written over the next row or short of
its tail, and the request reports Success with it. Here:

* the decode publishes its row sizes at registration (one frame after stock's,
  :func:`core.aux_rows.encode_aux_item_lens`; the manager class adds it) and the
  prefill notes them (:meth:`AuxRowCheckMixin._note_aux_lens`);
* the prefill checks every row of a room against them before sending any
  (``send_aux_tcp``); a mismatch fails the room on both sides with a reason
  naming the buffer, the row and both lengths, and nothing is sent;
* the decode checks every row it receives (``_handle_aux_data``) and fails the
  room with the reason instead of writing or dropping it.

How a room fails and how rows are sent depend on the release (probe
``mori_sender_notifies_status``): from 0.5.20 transfer workers conclude rooms
through ``conclude_failure`` and the rows go out on the status socket (see
:mod:`.metadata_order`); up to 0.5.19 the rows go out through stock's
``send_aux_tcp`` and the status later through ``notify_decode_status`` (a
failure, with the recorded reason, through the sender up to 0.5.18), and on
0.5.19 a refusal is concluded through the manager's ``_conclude_room_failure``
(probe ``mori_conclude_room_failure``).
"""

from __future__ import annotations

import logging
import struct
import threading
from typing import Dict, List, Tuple

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mori import conn as _conn
from sglang.srt.utils.network import NetworkAddress

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.core.aux_rows import AuxRowError, aux_row_problem, decode_aux_item_lens

logger = logging.getLogger("sglang_disagg_ext.mori")

FIX = "F12"


class AuxRowCheckMixin:
    """Metadata rows checked on both sides; see the module docstring. Mixed in before the
    stock ``MoriKVManager`` (or a subclass of it)."""

    def __init__(self, *args, **kwargs):
        """Contract: SGLang builds one manager per scheduler process, on the scheduler
        thread at startup; the stock constructor starts the bootstrap (prefill) or
        decode thread, which read these fields: set before ``super().__init__``."""
        # (decode endpoint, port) -> that decode's row size per metadata buffer
        self._peer_aux_lens: Dict[Tuple[str, int], List[int]] = {}
        self._peer_aux_lock = threading.Lock()
        # Up to 0.5.19: rooms whose rows this prefill refused inside add_transfer_request.
        self._rows_refused: set = set()
        super().__init__(*args, **kwargs)

    def _note_aux_lens(self, payload: List[bytes], frames: int) -> None:
        """Prefill bootstrap thread, after stock (or F3) handled a registration: keep the
        decode's row sizes if it sent them (frame ``frames`` of ``payload``, the message
        without the guard). Never raises: an unreadable frame is logged and the peer is
        served with this side's row sizes as the reference."""
        if len(payload) <= frames:
            return  # stock decode
        try:
            lens = decode_aux_item_lens(payload[frames])
            key = (payload[1].decode("ascii"), int(payload[2].decode("ascii")))
        except (AuxRowError, ValueError, UnicodeDecodeError) as exc:
            logger.error("mori-ext: decode registration carries an unreadable metadata row-size frame: %s", exc)
            return
        if lens is not None:
            with self._peer_aux_lock:
                self._peer_aux_lens[key] = lens

    # -- prefill: rows on the status channel -------------------------------------------------------------
    def send_aux_tcp(self, peer_info, prefill_aux_index: int, dst_aux_index: int, room: int):
        """Stock ``send_aux_tcp`` (0.5.23 mori/conn.py:1585-1608), rows checked, then
        sent on the status socket (from 0.5.20) or handed to stock's (up to 0.5.19).

        Contract: prefill, for the last chunk of ``room``, inside stock's submit path:
        from 0.5.19 on a transfer worker (``_submit_kv_transfer``; from 0.5.20 also
        from ``send_aux_rdma`` when the engine path cannot serve the peer), on
        0.5.13-0.5.18 inside ``add_transfer_request`` on a transfer worker
        (``MoriKVSender._run_chunk``), up to 0.5.12.x inside ``add_transfer_request``
        on the scheduler thread. The room's status is sent after this returns, from
        the same thread or later from the sender's poll. Returns no
        ``TransferStatus`` (as stock). Must not raise for a bad row: the room is
        concluded Failed with the reason and nothing is sent.
        """
        legacy = releases.features().mori_sender_notifies_status
        with self._peer_aux_lock:
            dst_lens = self._peer_aux_lens.get((peer_info.endpoint, peer_info.dst_port))
        # The rows stock sends: up to 0.5.19 one per prefill buffer, from 0.5.20 up to decode's count.
        num_bufs = len(self.kv_args.aux_data_ptrs)
        if not legacy:
            num_bufs = min(num_bufs, len(peer_info.dst_aux_mem_descs))
        rows = []
        for i in range(num_bufs):
            length = self.kv_args.aux_item_lens[i]
            data = _conn.AuxDataCodec.serialize_data_from_buffer(
                self.kv_args.aux_data_ptrs[i] + length * prefill_aux_index, length
            )
            expected = length if dst_lens is None else (dst_lens[i] if i < len(dst_lens) else None)
            problem = aux_row_problem(i, dst_aux_index, len(data), expected, sender_len=length)
            if problem is not None:
                self._fail_room(room, problem, "prefill")
                return []
            rows.append((i, data))
        if legacy:
            # Up to 0.5.19 stock sends the rows and, later on the same thread, the status through
            # one socket per thread and endpoint (0.5.12.post1+ ``_connect_threadsafe``; 0.5.10.post1
            # and 0.5.11 open one per message, see the module docstring): stock's send, now checked.
            return super().send_aux_tcp(peer_info, prefill_aux_index, dst_aux_index, room)
        na = NetworkAddress(peer_info.endpoint, peer_info.dst_port)
        for i, data in rows:
            self._send_multipart_locked(
                na.to_tcp(),
                [
                    _conn.MoriKVManager.AUX_DATA_HEADER,
                    str(room).encode("ascii"),
                    str(i).encode("ascii"),
                    str(dst_aux_index).encode("ascii"),
                    struct.pack(">I", len(data)),
                    data,
                ],
                is_ipv6=na.is_ipv6,
            )
        return []

    def add_transfer_request(self, bootstrap_room: int, *args, **kwargs):
        """Stock; up to 0.5.18 a room whose rows this class refused stays Failed.

        Contract: prefill, per chunk: up to 0.5.12.x from ``MoriKVSender.send`` on the
        scheduler thread, on 0.5.13-0.5.18 from ``MoriKVSender._run_chunk`` on a
        transfer worker; there it sends the last chunk's rows itself (``send_aux`` ->
        ``send_aux_tcp``, same thread), and 0.5.10.post1 then marks the room Success,
        which would override the Failed the row check set (``CommonKVManager.update_status``
        takes the max of two non-Failed states and Failed is the lowest). From 0.5.19 it
        only queues the chunk for a transfer worker, and nothing is added here (the
        refusal is concluded through ``_conclude_room_failure`` / ``conclude_failure``).
        Returns stock's value; never raises for a refused row.
        """
        out = super().add_transfer_request(bootstrap_room, *args, **kwargs)
        if self._rows_refused and bootstrap_room in self._rows_refused:
            self._rows_refused.discard(bootstrap_room)
            self.update_status(bootstrap_room, KVPoll.Failed)
        return out

    # -- decode: rows checked ------------------------------------------------------------------------------
    def _handle_aux_data(self, msg: List[bytes]):
        """Stock ``_handle_aux_data`` (:1971-1985) with every row checked before it is written.

        Contract: decode status thread, for each ``AUX_DATA`` message, in the
        order the prefill's socket delivered them (before that prefill's status
        for the room). Must not raise on a bad message; a row that does not fit
        fails its room here (decode) with the reason and is not written.
        """
        try:
            room = int(msg[1].decode("ascii"))
            buffer_index = int(msg[2].decode("ascii"))
            row = int(msg[3].decode("ascii"))
            (declared,) = struct.unpack(">I", msg[4])
            data = msg[5]
        except (IndexError, ValueError, UnicodeDecodeError, struct.error) as exc:
            logger.error("mori-ext: unreadable metadata row message (%d frames): %s", len(msg), exc)
            return
        args = self.kv_args
        row_len = args.aux_item_lens[buffer_index] if 0 <= buffer_index < len(args.aux_item_lens) else None
        num_rows = args.aux_data_lens[buffer_index] // row_len if row_len else None
        problem = aux_row_problem(buffer_index, row, len(data), row_len, declared_len=declared, num_rows=num_rows)
        if problem is not None:
            self._fail_room(room, problem, "decode")
            return
        # MoRI's module has the codec in its namespace on every release (its own class up to 0.5.11).
        _conn.AuxDataCodec.deserialize_data_to_buffer(args, buffer_index, row, data)

    def _fail_room(self, room: int, problem: str, side: str) -> None:
        reason = f"mori-ext (F12) {side}: {problem}"
        logger.error("room %s: %s", room, reason)
        metrics.count("transfer_failures_total", fix=FIX, reason="metadata_row_length")
        if room not in self.request_status:
            return  # cleared: a record now would be adopted by a later room of that number
        if side == "prefill" and not releases.features().mori_sender_notifies_status:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)  # tells decode too
        elif side == "prefill" and releases.features().mori_conclude_room_failure:
            # 0.5.19: a transfer worker sends the room's status; this tells decode with the reason.
            self.record_failure(room, reason)
            self._conclude_room_failure(room, reason)
        elif side == "prefill":
            # 0.5.10.post1-0.5.18: recorded and Failed; the sender's poll sends Failed with this
            # reason to decode. add_transfer_request re-marks it (0.5.10.post1 sets Success after
            # the rows, on the same thread).
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
            self._rows_refused.add(room)
        else:
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
