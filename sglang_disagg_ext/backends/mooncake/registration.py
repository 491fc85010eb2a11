"""F9 for ``mooncake-ext``: prefill refuses, at registration, a decode whose metadata buffers it cannot serve.

Stock 0.5.23 compares the metadata (aux) buffer counts when a decode
registers (``common/conn.py`` ``check_peer_aux_buffer_count``), only logs a
difference, and then ``send_aux`` pairs the buffers by position, sending the
shorter list with prefill's row sizes: decode reads metadata that is not
what prefill wrote (or never gets the buffer it enabled), and both sides
report Success. A difference comes from an optional buffer enabled on one
engine only (KV checksum, sampling mask, DSA top-k seed).

Here, on prefill:

* the verdict is reached in ``check_peer_aux_buffer_count``, where stock
  makes its check, from decode's buffer count and, when an ``-ext`` decode
  published them (the pool-sizes frame, :mod:`.peers`), its
  row sizes (:mod:`..core.registration_check`). A pair that cannot be served
  gets ONE error line at registration, naming the counts and sizes (in place of
  stock's, which says the leading buffers are sent);
* every request to a refused decode session is concluded Failed in
  ``add_transfer_request`` before anything is queued for the engine, with
  that reason (:class:`.peers.PeerPoolsMixin` holds the refused sessions of
  F9 and F18 and concludes their rooms); stock's status message carries it to
  every decode rank of the room. No KV page and no metadata row of decode is written, and the session
  is not marked failed: a decode that registers again with matching buffers
  is served;
* a stock decode (no row sizes published) is checked on the count only; where
  the counts match it gets stock behaviour and one INFO line saying so.

Where the verdict is reached, by release
(``releases.features().mooncake_aux_count_check``):

* 0.5.23: in stock's ``check_peer_aux_buffer_count`` (above);
* 0.5.10.post1-0.5.22, which have no such check and pair the buffers by
  position whatever their counts and sizes (``send_aux``: decode's list
  indexes prefill's row sizes, 0.5.22 mooncake/conn.py:1755-1759): as the
  registration arrives on the bootstrap thread, where :mod:`.peers`
  notes the pool-sizes frame, before stock parses the message; decode's count
  is stock frame 5 (packed 8-byte pointers, ``KVArgsRegisterInfo.from_zmq``
  in every release). The refusal is concluded by hand there
  (``peers.conclude_room_failed``: reason, status, every decode rank
  told; an ``-ext`` decode gets the reason frame).
"""

from __future__ import annotations

import logging

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.mooncake.peers import PeerPoolsMixin
from sglang_disagg_ext.core.registration_check import aux_pairing_problem

logger = logging.getLogger("sglang_disagg_ext.mooncake.registration")

FIX = "F9"
REFUSED_LINE = "refused at registration"
METRIC_REASON = "metadata buffers cannot be paired"


class RegistrationCheckMixin(PeerPoolsMixin):
    """Refuses a decode registration whose metadata buffers prefill cannot serve; see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which
        may read a registration at once, so the tables exist before ``super()``.
        """
        # Bootstrap thread only.
        self._f9_count_only = set()  # stock decodes already told "count checked only"
        super().__init__(*args, **kwargs)

    # -- prefill: the verdict, once per registration -------------------------
    def check_peer_aux_buffer_count(self, peer: str, num_remote: int) -> None:
        """Refuse ``peer`` when its metadata buffers cannot be paired with prefill's.

        Contract: prefill only, 0.5.23+: stock's ``_publish_peer_registration``
        calls it on the bootstrap thread once per decode registration, after
        the message was parsed and before the registration is published in
        ``decode_kv_args_table`` (so before any request from that session is
        read). ``num_remote`` is decode's buffer count (frame 5). Stock only
        logs a difference; this replaces that line with the refusal (stock's
        says the leading buffers are sent, which a refused session never
        gets). Must not raise: the bootstrap thread would end.
        """
        if self._f9_verdict(peer, num_remote) == "unchecked":
            return super().check_peer_aux_buffer_count(peer, num_remote)
        return None

    def _note_registration(self, msg) -> None:
        """:class:`PeerPoolsMixin`'s note of the pool-sizes frame, then (releases without
        stock's count check, up to 0.5.22) the verdict on the same message.

        Runs on prefill's bootstrap thread for each decode registration, before stock
        parses it; it must never raise into that thread (the socket wrapper also
        guards it). Decode's buffer count is stock frame 5: its packed 8-byte
        metadata buffer pointers.
        """
        super()._note_registration(msg)
        if releases.features().mooncake_aux_count_check:
            return  # 0.5.23: check_peer_aux_buffer_count gets it from stock
        try:
            peer = bytes(msg[3]).decode("ascii")
            num_remote = len(bytes(msg[5])) // 8
        except (UnicodeDecodeError, IndexError):
            return  # stock's own parse of this message reports it
        self._f9_verdict(peer, num_remote)

    def _f9_verdict(self, peer: str, num_remote: int) -> str:
        """Record whether decode session ``peer`` can be served: "served", "refused"
        (its ONE error line logged) or "unchecked" (the check itself failed: stock
        behaviour). Never raises."""
        # Noted from the registration frame before stock parsed it (PeerPoolsMixin).
        bounds = self._peer_bounds.get(peer)
        rows = None if bounds is None else bounds.aux_item_lens
        try:
            reason = aux_pairing_problem(self.kv_args.aux_item_lens, int(num_remote), rows)
        except Exception:  # noqa: BLE001 - a check that cannot run leaves stock behaviour
            logger.exception("decode session %s: metadata buffer check failed; stock behaviour", peer)
            self._accept_session(peer, FIX)
            return "unchecked"
        if reason is None:
            self._accept_session(peer, FIX)
            if rows is None and peer not in self._f9_count_only:
                self._f9_count_only.add(peer)
                logger.info(
                    "decode session %s published no metadata row sizes (a stock decode): only its buffer "
                    "count (%d, as prefill's) was checked",
                    peer,
                    num_remote,
                )
            return "served"
        self._refuse_session(peer, FIX, METRIC_REASON, f"decode session {peer}: {reason}")
        logger.error("decode session %s %s; every request to it ends Failed: %s", peer, REFUSED_LINE, reason)
        return "refused"
