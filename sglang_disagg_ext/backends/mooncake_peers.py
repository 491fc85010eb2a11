"""What ``mooncake-ext`` prefill knows of each decode's pools (shared by F6 and F9).

A decode's stock registration message carries its buffer pointers and counts
but not how many pages or rows each pool holds, nor its metadata row sizes.
An ``-ext`` decode appends them as one extra, trailing frame
(:mod:`..core.index_bounds`); stock ``KVArgsRegisterInfo.from_zmq`` reads fixed
positions and ignores it, so a stock prefill is unaffected. An ``-ext``
prefill notes the frame per decode session as the registration arrives
(``_peer_bounds``), before stock parses the message; a decode that published
none (stock) is named once at INFO and left unchecked.

Needs 0.5.23's hooks (``build_receiver_registration_message``,
``_make_worker_recv``); older releases build the registration inside the
receiver, so nothing is published there.
"""

from __future__ import annotations

import logging

from sglang_disagg_ext.backends.shared import note_peer_bounds
from sglang_disagg_ext.core.index_bounds import IndexBoundsError, bounds_of, encode_frame

logger = logging.getLogger("sglang_disagg_ext.mooncake.peers")

# First frame of a decode registration message (stock: the room field reads "None").
REGISTRATION = b"None"


class PeerPoolsMixin:
    """Publishes (decode) and notes (prefill) each decode's pool sizes; see the module docstring."""

    # Stock Mooncake's status message is (room, status, rank): decode learns
    # only "Failed" and reports SGLang's generic "prefill might be dead". With
    # this, prefill appends the reason frame that SGLang's common
    # ``parse_kv_status_message`` already reads on any decode (stock included),
    # so decode can say why a request was refused.
    kv_status_msg_carries_reason = True

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which
        may read a registration at once, so the table exists before ``super()``.
        """
        # session id -> PoolBounds; written by the bootstrap thread, read by
        # the scheduler thread (single dict operations, no lock needed).
        self._peer_bounds = {}
        self._unchecked_peers = set()
        super().__init__(*args, **kwargs)

    # -- decode: publish the pool sizes --------------------------------------
    def build_receiver_registration_message(self):
        """Stock's registration frames plus one trailing pool-bounds frame.

        Contract: decode only. ``CommonKVReceiver._register_kv_args`` calls it on
        the scheduler thread when a receiver first reaches a prefill, and sends
        the frames to every prefill rank of that bootstrap address. It may
        assume ``kv_args`` is filled; it must not reorder or drop stock's frames
        (a stock prefill parses them by position and ignores what follows).
        """
        frames = list(super().build_receiver_registration_message())
        args = self.kv_args
        try:
            bounds = bounds_of(
                args.kv_data_lens,
                args.kv_item_lens,
                args.aux_data_lens,
                args.aux_item_lens,
                getattr(args, "state_data_lens", None) or [],
                getattr(args, "state_item_lens", None) or [],
            )
        except IndexBoundsError as exc:
            # Registration must still go out: the peer then runs unchecked.
            logger.error("not publishing pool sizes to prefill: %s", exc)
            return frames
        return frames + [encode_frame(bounds)]

    # -- prefill: read them -----------------------------------------------------
    def _make_worker_recv(self, *args, **kwargs):
        """Stock's receive function, noting each decode registration's pool sizes.

        Contract: both sides call it once per worker thread at startup
        (``start_prefill_thread`` / ``start_decode_thread``); the function it
        returns runs on that thread for every message, and its result goes
        unchanged to stock's handling (``None`` = nothing received). The wrapper
        only reads prefill's registration messages; it must never raise into
        the bootstrap thread, which would end it.
        """
        recv = super()._make_worker_recv(*args, **kwargs)
        if self.disaggregation_mode.name != "PREFILL":
            return recv

        def recv_noting_bounds():
            msg = recv()
            if msg and len(msg) > 3 and msg[0] == REGISTRATION:
                self._note_registration(msg)
            return msg

        return recv_noting_bounds

    def _note_registration(self, msg) -> None:
        try:
            session = bytes(msg[3]).decode("ascii")
        except UnicodeDecodeError:
            return  # stock's own parse of this message reports it
        note_peer_bounds(
            self._peer_bounds, self._unchecked_peers, session, msg, logger, "decode session",
            "decode session %s published no pool sizes (a stock decode): destination index checks are off "
            "for it (a request with an out-of-pool index fails its whole session, as in stock SGLang), and "
            "its metadata buffers are checked by count only",
        )
