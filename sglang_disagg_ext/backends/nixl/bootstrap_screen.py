"""F15 mixin for ``nixl-ext``: no message kills NIXL prefill's bootstrap thread.

Stock's prefill bootstrap loop (``_start_bootstrap_thread``, every release 0.5.10.post1-0.5.23;
0.5.23 nixl/conn.py:3355-3426) has no per-message handler: one foreign or malformed message on
its socket (another service's traffic on the port, a peer of another version, a truncated
frame) ends the thread, and every later registration and request of every decode waits in
Bootstrapping: for ever up to 0.5.17 (NIXL's sender has no bootstrap deadline there), 300 s from
0.5.18. 0.5.21+ log the traceback before the thread ends (``bootstrap_thread_guarded``).

Here the thread reads its socket through a filter (:class:`.shared.FilteringSocket`) that asks
:func:`core.bootstrap_screen.screen`, with stock's own parsers, whether stock's loop could
handle the message. One that it could not is dropped before the loop sees it: an ERROR naming
the sender, at most one per kind a minute with the count held back in between (the project's
``core.rate_limit.EveryInterval``), ``bootstrap_messages_dropped_total{backend,reason}``,
and where it names a room this prefill holds, that room ends Failed with the reason (SGLang's
own path tells decode). Every other message reaches stock's loop unchanged.

The mixin sits last before SGLang's manager in each ``nixl-ext`` manager's bases, so its
filter is the outermost: it sees each message as stock's loop would, after the plugin's own
filters (verification notices, decode's ABORT on 0.5.13-0.5.15, pool sizes) took their frames off.
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl import conn as nixl_conn
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.backends.common.shared import FilteringSocket
from sglang_disagg_ext.core.bootstrap_screen import screen
from sglang_disagg_ext.core.rate_limit import EveryInterval

logger = logging.getLogger("sglang_disagg_ext.nixl")

# Staging's messages, which stock's loop handles before its GUARD assert (0.5.13+).
_STAGING_TAGS = (b"WATERMARK", b"STAGING_RSP")
# Keyed by kind only (a handful): a peer sending garbage under ever-new names grows nothing.
_LOG_INTERVAL_S = 60.0


class BootstrapScreenMixin:
    """F15: see the module docstring. Cooperative; last before ``NixlKVManager`` in the bases."""

    # Tags of the plugin's own messages that this class's ``_handle_abort_notification`` takes
    # (the verified-transfer mixin, in front of this one, names its mismatch notice).
    plugin_bootstrap_tags = ()

    def _start_bootstrap_thread(self, *args, **kwargs):
        """Stock's bootstrap thread, reading through the screen.

        Contract: prefill only; stock's constructor calls it once, after ``server_socket``
        is bound, before any decode can register. The thread it starts reads
        ``self.server_socket`` for every message until the process ends. Every mixin before
        this one in the bases has wrapped the socket already. Must start exactly the thread
        stock starts, and hand stock's loop every message it can handle, unchanged.
        """
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            # The plugin's own messages reach stock's loop only where that loop offers decode's
            # messages to ``_handle_abort_notification``, which takes them; elsewhere the plugin's
            # own filter, inside this one, has taken them already.
            offered = releases.stock_bootstrap_reads_notices(type(self))
            self._f15_passed = _STAGING_TAGS + (tuple(self.plugin_bootstrap_tags) if offered else ())
            self._f15_log = EveryInterval(_LOG_INTERVAL_S)
            self.server_socket = FilteringSocket(self.server_socket, self._f15_screen, logger)
        return super()._start_bootstrap_thread(*args, **kwargs)

    def _f15_screen(self, msg):
        """Bootstrap thread: None (stock reads ``msg``) or ``CONSUMED`` (dropped, see above)."""
        rejection = screen(msg, nixl_conn.GUARD, self._f15_passed, releases.features().nixl_bootstrap_handles_abort,
                           nixl_conn.KVArgsRegisterInfo.from_zmq, nixl_conn.TransferInfo.from_zmq)
        if rejection is None:
            return None
        metrics.count("bootstrap_messages_dropped_total", backend="nixl", reason=rejection.kind)
        held_back = self._f15_log.admit(rejection.kind)
        if held_back is not None:
            logger.error("nixl-ext (F15): prefill bootstrap socket (engine rank %s): dropped %s from %s; stock's "
                         "bootstrap thread would have died of it (%d more of this kind since the last such line)",
                         getattr(self.kv_args, "engine_rank", "?"), rejection.detail,
                         rejection.sender or "an unknown sender", held_back)
        room = rejection.room
        if room is not None and room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, f"nixl-ext (F15): decode's bootstrap message could not be read: "
                                      f"{rejection.detail}")
            self.update_status(room, KVPoll.Failed)
        return FilteringSocket.CONSUMED
