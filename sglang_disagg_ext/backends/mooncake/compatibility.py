"""F18 for ``mooncake-ext``: prefill refuses, at registration, a decode whose KV pages are laid out otherwise.

Stock Mooncake writes decode's KV pages at ``dst_ptr + index * item_len`` with
prefill's ``item_len`` and never compares it with decode's where both run the
same attention TP (every release 0.5.10.post1-0.5.23, ``_send_kvcache_generic``).
A decode serving another model configuration (head dim, KV dtype, page size)
is written at the wrong offsets: with larger decode pages both sides report
Success and the bytes sit in pages no request targeted; with smaller ones the
engine rejects the writes and stock fails the whole session with a generic
reason. A rolling upgrade that changes one pool's config meets exactly this.

Here, on prefill (the pure rules: :mod:`..core.peer_record`):

* an ``-ext`` decode publishes its compatibility record (plugin version, SGLang
  release, record format, page size, KV bytes per page, KV heads) in the
  pool-sizes frame its registration already carries (:mod:`.peers`);
* as each registration arrives on prefill's bootstrap thread, before stock
  parses it, prefill compares the record with its own: a session whose layout
  differs gets ONE error naming every differing field, both values, and both
  sides' release and plugin version; a compatible session of another release
  or plugin version gets one INFO line (a rolling upgrade, served);
* every request to a refused session is concluded Failed in
  ``add_transfer_request`` before anything is queued for the engine, with that
  reason, told to every decode rank of the room (:class:`.peers.PeerPoolsMixin`
  holds the sessions F9 and F18 refused and concludes their rooms).
  No byte of decode is written and the session is not marked failed: a decode
  that registers again with a matching layout is served;
* a decode that published no record (stock, or ``-ext`` before F18) is not
  checked here: stock behaviour.
"""

from __future__ import annotations

import logging

from sglang_disagg_ext.backends.common.shared import own_peer_record
from sglang_disagg_ext.backends.mooncake.peers import PeerPoolsMixin
from sglang_disagg_ext.core import peer_record

logger = logging.getLogger("sglang_disagg_ext.mooncake.compatibility")

FIX = "F18"
REFUSED_LINE = "refused at registration"
METRIC_REASON = "KV cache layouts differ"


class PeerCompatibilityMixin(PeerPoolsMixin):
    """Refuses a decode registration whose KV layout differs from prefill's; see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which may read a
        registration at once, so the tables exist before ``super()``.
        """
        # Bootstrap thread only.
        self._f18_noted = set()  # compatible sessions of another release / plugin version, logged once
        super().__init__(*args, **kwargs)

    def _note_registration(self, msg) -> None:
        """:class:`PeerPoolsMixin`'s note of the pool-sizes frame, then the F18 verdict on it.

        Runs on prefill's bootstrap thread for each decode registration, before stock parses
        it (so before any request of that session is read); must never raise into that thread.
        """
        super()._note_registration(msg)
        try:
            session = bytes(msg[3]).decode("ascii")
        except (UnicodeDecodeError, IndexError):
            return  # stock's own parse of this message reports it
        bounds = self._peer_bounds.get(session)
        theirs = None if bounds is None else bounds.peer
        if theirs is None:
            self._accept_session(session, FIX)
            return
        try:
            ours = own_peer_record(self)
            differences = peer_record.incompatibilities(ours, theirs)
        except Exception:  # noqa: BLE001 - a check that cannot run leaves stock behaviour
            logger.exception("decode session %s: compatibility check failed; stock behaviour", session)
            self._accept_session(session, FIX)
            return
        if differences:
            reason = peer_record.refusal(session, ours, theirs, differences)
            self._refuse_session(session, FIX, METRIC_REASON, reason)
            logger.error("%s; %s, every request to it ends Failed", reason, REFUSED_LINE)
            return
        self._accept_session(session, FIX)
        if peer_record.identity(ours) != peer_record.identity(theirs) and session not in self._f18_noted:
            self._f18_noted.add(session)
            logger.info("decode session %s runs %s, this prefill %s: KV layouts match, served", session,
                        peer_record.identity(theirs), peer_record.identity(ours))
