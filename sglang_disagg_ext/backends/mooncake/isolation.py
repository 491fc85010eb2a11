"""F6 for ``mooncake-ext``: one bad request never poisons a decode peer's session.

Stock prefill hands decode's indices to the engine unchecked. An index
outside decode's pool makes the transfer fail, and the transfer worker then
puts decode's whole Mooncake session into ``failed_sessions`` after that one
failure: every following request to that decode fails ("remote mooncake
session ... is not alive") until a probe succeeds (30 s, backing off to
300 s) or decode registers again.

Here:

* decode appends its pool sizes (:mod:`..core.index_bounds`) as one extra,
  trailing frame of its registration message; stock ``KVArgsRegisterInfo.from_zmq``
  reads fixed positions and ignores it, so a stock prefill is unaffected;
* prefill reads that frame when present and checks each request's KV, aux
  and state destination indices in ``add_transfer_request``, before the room
  is queued for the engine. A bad index ends the room Failed on prefill and,
  through stock's own status message, on every decode rank of the room, with
  a reason naming the component, the index and the pool size. The session is
  not marked: the next request to the same decode is served;
* a peer that published no sizes (stock decode) gets stock behaviour and one
  INFO line saying so at its registration;
* a transfer that fails for any other reason fails its room as stock does,
  but the session is marked only once the peer also fails a probe
  (:class:`ProbeFirstSessions`). Stock marks it after the one failure: a
  link that drops a single write then fails every request to that decode
  until the probe loop's next pass (30 s, backing off to 300 s). A peer that
  is really gone fails its probe and is marked as stock marks it.

On 0.5.23 through stock's hooks (``build_receiver_registration_message``,
``_make_worker_recv``, ``conclude_failure``, ``_send_probe``); on 0.5.10.post1-
0.5.22, whose decode builds the registration inside the receiver, through
:class:`.peers.MooncakeExtKVReceiver` and a wrapped server socket
(:mod:`.peers`), the three steps of ``conclude_failure`` by hand where
the release has none (before 0.5.20), and the engine's own ``send_probe`` (no
manager ``_send_probe`` there; up to 0.5.12.x stock has no probe loop at all: a
marked session stays marked until decode registers again). Flat layout (0.5.10.post1,
0.5.11): the request's one state page list is checked against the one state
component decode published.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

from sglang_disagg_ext import metrics
from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.mooncake.peers import PeerPoolsMixin, conclude_room_failed, state_kinds_of
from sglang_disagg_ext.core.index_bounds import check_destination

logger = logging.getLogger("sglang_disagg_ext.mooncake.isolation")

# Far more than the rooms one prefill has in flight at once.
_ROOMS_REMEMBERED = 4096


class RequestIsolationMixin(PeerPoolsMixin):
    """Refuses a request whose decode indices fall outside decode's pools; see the module docstring."""

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per process)."""
        # Rooms whose indices passed (scheduler thread only); the oldest are
        # forgotten, so a room that never reaches its last chunk cannot leak.
        self._rooms_checked = collections.OrderedDict()
        super().__init__(*args, **kwargs)
        # Prefill only (stock makes the set there): see ProbeFirstSessions.
        if isinstance(self.__dict__.get("failed_sessions"), set):
            self.failed_sessions = ProbeFirstSessions(self, self.failed_sessions)

    def add_transfer_request(self, bootstrap_room, *args, **kwargs):
        """Stock ``add_transfer_request``, after checking decode's indices for the room.

        Contract: prefill only, on the scheduler thread, once per chunk
        (``MooncakeKVSender.send``) after the room reached WaitingForInput, so
        ``transfer_infos[room]`` holds every decode rank's indices. Stock
        returns early for a Failed room and queues the chunk for a transfer
        thread otherwise. A refused room is concluded Failed here (stock's
        ``conclude_failure``: reason recorded, status set, every non-dummy decode
        rank told) and nothing is queued; the session is never marked. Must not
        raise for a bad index: the scheduler thread would die.
        """
        # A room's decode indices are all known once it is WaitingForInput and do
        # not change: check them on its first chunk only, not again per chunk.
        if bootstrap_room in self._rooms_checked:
            return super().add_transfer_request(bootstrap_room, *args, **kwargs)
        reason = self._destination_problem(bootstrap_room)
        if reason is None:
            if bootstrap_room in self.request_status and self.transfer_infos.get(bootstrap_room):
                self._rooms_checked[bootstrap_room] = None
                while len(self._rooms_checked) > _ROOMS_REMEMBERED:
                    self._rooms_checked.popitem(last=False)
            return super().add_transfer_request(bootstrap_room, *args, **kwargs)
        logger.error("room %s refused before transfer: %s", bootstrap_room, reason)
        # "kv", "aux" or "state": the component class, never request data.
        metrics.count("requests_refused_total", fix="F6", reason=f"{_component_class(reason)} index out of pool")
        conclude_room_failed(self, bootstrap_room, reason)
        return None

    def _destination_problem(self, room):
        # .get: a transfer thread may pop the room concurrently.
        infos = self.transfer_infos.get(room)
        if room not in self.request_status or not infos:
            return None  # stock returns early for these
        state_kinds = state_kinds_of(self.kv_args)
        flat = releases.current_policy().layout is releases.StateLayout.FLAT
        for session, info in list(infos.items()):
            if info.is_dummy:
                continue
            bounds = self._peer_bounds.get(session)
            if bounds is None:
                continue
            registration = self.decode_kv_args_table.get(session)
            # DCP relayout addresses decode KV by token, not page: its KV
            # indices are not pool pages.
            kv = None if getattr(registration, "requires_dcp_relayout", False) else info.dst_kv_indices
            state = info.dst_state_indices
            if flat:  # one component: the request's page list itself
                state = [state] if state is not None and len(state) else []
            reason = check_destination(bounds, kv, info.dst_aux_index, state, state_kinds)
            if reason is not None:
                return f"decode session {session}: {reason}"
        return None


def _component_class(reason: str) -> str:
    """"kv", "aux" or "state" for a refusal reason (a metric label: never request data)."""
    for name, marker in (("kv", " kv: "), ("aux", " aux: "), ("state", " state component ")):
        if marker in f" {reason}":
            return name
    return "other"


class ProbeFirstSessions(set):
    """Prefill's ``failed_sessions`` whose ``add`` asks the peer before it blacklists it.

    Stock's transfer thread calls ``failed_sessions.add(session)`` (holding
    ``session_lock``) after one failed engine call, and from then on every request
    to that decode fails without a transfer until stock's probe loop lifts it.
    Here ``add`` only queues the session for one probe (stock's own
    ``_send_probe``, the engine's ``send_probe``) on a thread of its own and
    returns: the failed room is already concluded Failed by stock. A peer that
    answers stays usable (the failure was that transfer's, not the peer's); one
    that does not is added to the set, and from there stock's probe loop,
    ``in`` checks and ``_unblacklist_session`` work on it unchanged. While the
    probe runs, requests to the peer go to the engine as before: each one that
    fails there fails alone. ``add`` never blocks and never raises.
    """

    def __init__(self, mgr, initial=()):
        super().__init__(initial)
        self._mgr = mgr
        self._pending = set()
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._probe_loop, name="disagg-ext-session-probe", daemon=True)
        self._thread.start()

    def add(self, session) -> None:
        # Called with stock's session_lock held: only bookkeeping here.
        if session in self or session in self._pending:
            return
        self._pending.add(session)
        self._queue.put(session)

    def _probe_loop(self) -> None:
        while True:
            session = self._queue.get()
            try:
                rc = _probe(self._mgr, session)
            except Exception as exc:  # never let this thread die
                logger.warning("probe of mooncake session %s raised: %s", session, exc)
                rc = -1
            with self._mgr.session_lock:
                self._pending.discard(session)
                if rc == 0:
                    self._mgr.session_failures.pop(session, None)
                else:
                    set.add(self, session)
            if rc == 0:
                logger.warning("a transfer to mooncake session %s failed, but the peer answers a probe: "
                               "only that request failed, the session stays usable", session)
            else:
                logger.error("mooncake session %s failed a transfer and its probe (rc=%s): "
                             "marked failed, as stock marks it", session, rc)
            metrics.count("session_probes_total", fix="F6", result="alive" if rc == 0 else "dead")


def _probe(mgr, session) -> int:
    """0 when the peer answers: stock's ``_send_probe`` (0.5.23: -1 when the engine
    raises), else the engine's own ``send_probe`` (Mooncake's TransferEngine, which
    SGLang's wrapper holds as ``engine.engine`` before 0.5.23)."""
    if releases.features().mooncake_send_probe:
        return mgr._send_probe(session)
    return mgr.engine.engine.send_probe(session)
