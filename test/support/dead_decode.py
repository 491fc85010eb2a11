"""Test-only prefill hook: decode is dead before prefill's engine writes to it (F6, a peer that is really gone).

``kill_decode_before_transfer(mgr)`` shadows two methods on the prefill manager
instance (``SGLANG_HARNESS_PREFILL_HOOK``, loaded by ``worker._run_prefill_hook``
right after the manager exists), so stock and ``-ext`` managers meet the same
fault at the same call:

* ``add_transfer_request`` for the fault room (``SGLANG_HARNESS_FAULT_ROOM``,
  default 1000): before the room is handed to the manager (and so before any
  engine write of it), the process serving decode's Mooncake session (the one
  listening on the session's port, which must be the decode worker whose PID
  decode's result file names) is SIGKILLed, and the call waits until that port
  refuses connections. The room's engine write then fails for real, against
  a dead peer: nothing in the engine or the manager is replaced.
* ``add_transfer_request`` for every later room: held until prefill has its
  verdict on the session (stock: the session in ``failed_sessions``, which the
  transfer thread adds after the failed write; ``-ext``: its probe counted in
  ``session_probes_total``, which its probe thread does after marking or
  keeping the session), so the later room meets that verdict and not a race
  with the probe. Bounded: ``VERDICT_WAIT_S``.

The engine's ``batch_transfer_sync`` / ``transfer_sync`` are wrapped to count
the calls to decode's session (they go to the real engine unchanged), split
by whether the later rooms had been handed over: a later room failed on a
blacklisted session reaches the engine zero times.

The hook returns an object whose ``report()`` the harness worker writes into
prefill's result (``ScenarioResult.prefill_hook_reports``), with the WARNING+
lines of any logger here that name decode's session (wave runs keep no
per-request log). Wave runs only
(``Scenario.wave`` >= 2, every room of the wave bootstrapped before the first
is sent): with one request at a time the later rooms' decode metadata would
never come. It lives here, outside the wheel.
"""

import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import psutil

FAULT_ROOM_ENV = "SGLANG_HARNESS_FAULT_ROOM"
GONE_WAIT_S = 10.0
VERDICT_WAIT_S = 10.0
PROBES_METRIC = "sglang_disagg_ext_session_probes_total"


def _room() -> int:
    return int(os.environ.get(FAULT_ROOM_ENV, "1000"))


def _peer_result_pid():
    """Decode's PID from its result file (the worker's ``--peer-result``), or None."""
    argv = sys.argv
    if "--peer-result" not in argv:
        return None
    try:
        with open(argv[argv.index("--peer-result") + 1]) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _listener_pid(port: int):
    """PID of the process listening on TCP ``port`` on this machine, or None."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def _refuses(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _probes_counted() -> float:
    """Sum of the plugin's session_probes_total samples in this process (0 without the plugin's metrics)."""
    if "sglang_disagg_ext.metrics" not in sys.modules:
        return 0.0
    from prometheus_client import REGISTRY

    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == PROBES_METRIC:
                total += sample.value
    return total


class _SessionLog(logging.Handler):
    """WARNING+ records, from any logger of this process, that name decode's session."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.session = None
        self.lines = []

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:
            return
        if self.session and self.session in msg and len(self.lines) < 20:
            self.lines.append(f"{record.levelname} {record.name}: {msg}"[:600])


class DeadDecode:
    def __init__(self, mgr):
        self.mgr = mgr
        self.room = _room()
        self.session = None
        self.decode_pid = None
        self.killed = False
        self.gone_after_s = None
        self.verdict = None
        self.verdict_after_s = None
        self.later_rooms = []
        self.calls_before_later_rooms = 0
        self.calls_after_later_rooms = 0
        self.error = None
        self._later_handed = False
        self._lock = threading.Lock()
        self._log = _SessionLog()
        logging.getLogger().addHandler(self._log)

    def report(self):
        return {
            "fault_room": self.room, "session": self.session, "decode_pid": self.decode_pid,
            "killed": self.killed, "gone_after_s": self.gone_after_s, "verdict": self.verdict,
            "verdict_after_s": self.verdict_after_s, "later_rooms": self.later_rooms,
            "engine_calls_to_session_before_later_rooms": self.calls_before_later_rooms,
            "engine_calls_to_session_after_later_rooms": self.calls_after_later_rooms,
            "session_log": list(self._log.lines), "error": self.error,
        }

    def count_call(self, session_id) -> None:
        if session_id != self.session:
            return
        with self._lock:
            if self._later_handed:
                self.calls_after_later_rooms += 1
            else:
                self.calls_before_later_rooms += 1

    def kill(self, room) -> None:
        """SIGKILL the process behind decode's session of ``room``; return once its port refuses."""
        infos = [i for i in self.mgr.transfer_infos.get(room, {}).values() if not i.is_dummy]
        if len(infos) != 1:
            raise RuntimeError(f"room {room}: {len(infos)} decode ranks, the hook handles one")
        self.session = self._log.session = infos[0].mooncake_session_id
        host, port = self.session.rsplit(":", 1)
        port = int(port)
        pid, named = _listener_pid(port), _peer_result_pid()
        if pid is None or pid != named or pid == os.getpid():
            raise RuntimeError(f"session {self.session}: listener PID {pid}, decode's result file names {named}")
        self.decode_pid = pid
        # The worker leads its own process group (the harness starts it so); kill that
        # group, which holds nothing else, and never this process's.
        if os.getpgid(pid) != pid or os.getpgid(0) == pid:
            raise RuntimeError(f"decode PID {pid} does not lead its own process group")
        t0 = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        self.killed = True
        while not _refuses(host, port):
            if time.monotonic() - t0 > GONE_WAIT_S:
                raise RuntimeError(f"decode session port {port} still accepts {GONE_WAIT_S}s after SIGKILL")
            time.sleep(0.01)
        self.gone_after_s = round(time.monotonic() - t0, 3)

    def wait_verdict(self) -> None:
        """Until prefill has decided about the session (see the module docstring), bounded."""
        t0 = time.monotonic()
        probes = type(self.mgr.failed_sessions) is not set  # -ext: ProbeFirstSessions
        while time.monotonic() - t0 < VERDICT_WAIT_S:
            with self.mgr.session_lock:
                marked = self.session in self.mgr.failed_sessions
            if (_probes_counted() >= 1) if probes else marked:
                self.verdict = "marked failed" if marked else "kept"
                break
            time.sleep(0.01)
        else:
            self.verdict = f"none within {VERDICT_WAIT_S}s"
        self.verdict_after_s = round(time.monotonic() - t0, 3)


def kill_decode_before_transfer(mgr) -> DeadDecode:
    state = DeadDecode(mgr)
    stock = mgr.add_transfer_request

    def add_transfer_request(bootstrap_room, *args, **kwargs):
        try:
            if bootstrap_room == state.room and not state.killed:
                state.kill(bootstrap_room)
            elif bootstrap_room != state.room and state.killed and bootstrap_room not in state.later_rooms:
                if state.verdict is None:
                    state.wait_verdict()
                with state._lock:
                    state._later_handed = True
                state.later_rooms.append(bootstrap_room)
        except Exception as exc:  # recorded for the test; the request goes on as it would
            state.error = f"{type(exc).__name__}: {exc}"
        return stock(bootstrap_room, *args, **kwargs)

    mgr.add_transfer_request = add_transfer_request

    engine = mgr.engine
    for name in ("batch_transfer_sync", "transfer_sync"):
        call = getattr(engine, name, None)
        if call is None:
            continue

        def counted(session_id, *args, _call=call, **kwargs):
            state.count_call(session_id)
            return _call(session_id, *args, **kwargs)

        setattr(engine, name, counted)
    return state
