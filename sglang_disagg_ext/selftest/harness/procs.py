"""Worker processes of the harness: started in their own session, stopped by their group id.

Two ways to start ``python -m <module> ARGS``, with the same handle:

* :class:`Child`: a fresh interpreter (``subprocess.Popen``). It pays SGLang's
  import every time: 6-7 s on a quiet 2-core machine, 9-19 s on a loaded one,
  against 0.1-0.3 s for everything a scenario then does (manager, engine,
  bootstrap, transfers; measured with the worker's ``timings``).
* :class:`ForkedChild`: forked from a *fork server*, an interpreter that has
  imported torch and SGLang's disaggregation modules once and then only forks
  (``forkserver``). Each worker is still a process of its own, started for one
  scenario and gone after it, so nothing a scenario leaves behind (a poisoned
  session, a dead thread, a registered buffer) reaches the next one.

:func:`spawn` picks the fork server unless ``SGLANG_HARNESS_FORKSERVER=0`` or
the server cannot start; one server per interpreter and ``PYTHONPATH`` (what
decides which SGLang and which stand-ins are imported). Every wait is bounded;
servers are stopped by their PID when this process exits.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import psutil

FORKSERVER_ENV = "SGLANG_HARNESS_FORKSERVER"
FORKSERVER_START_S = 180.0  # imports of torch + SGLang on a loaded 2-core machine
REPLY_S = 30.0
LOG_TAIL_CHARS = 6000


def _group_alive(pgid: int) -> bool:
    """Any process left in the session/group led by ``pgid`` (e.g. after the leader exited)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and os.getsid(proc.info["pid"]) == pgid:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    return True
        except (OSError, psutil.Error):
            continue
    return False


class _Handle:
    """What the harness needs of a worker: poll, kill by group, exit code, log tail."""

    role: str
    log_path: str
    pgid: int
    killed: bool

    @property
    def pid(self) -> int:
        return self.pgid

    def poll(self) -> Optional[int]:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def _wait(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.02)

    def kill(self) -> bool:
        """SIGKILL the worker's process group if anything of it is still there."""
        did = False
        if self.poll() is None or _group_alive(self.pgid):
            try:
                os.killpg(self.pgid, signal.SIGKILL)
                did = True
            except ProcessLookupError:
                pass
        self._wait(10.0)
        self.killed = self.killed or did
        return did

    def close(self) -> None:
        pass

    def tail(self, n: int = LOG_TAIL_CHARS) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


class Child(_Handle):
    """A worker in a fresh interpreter, leading its own session and process group."""

    def __init__(self, role: str, cmd: List[str], env: Dict[str, str], log_path: str, cwd: str):
        self.role = role
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pgid = self.proc.pid
        self.killed = False

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def _wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd
            pass

    def close(self) -> None:
        try:
            self._log.close()
        except OSError:
            pass


class ForkedChild(_Handle):
    """A worker forked by a :class:`ForkServer`; its exit code arrives in ``<log>.rc``."""

    def __init__(self, role: str, pid: int, log_path: str, server: "ForkServer"):
        self.role = role
        self.log_path = log_path
        self.pgid = pid  # the forked child calls setsid() first
        self.killed = False
        self._server = server
        self._rc: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self._rc is None:
            try:
                with open(self.log_path + ".rc") as f:
                    self._rc = int(f.read().strip())
            except (OSError, ValueError):
                if not self._server.alive():
                    # The server reaps its children; gone, it reaps nothing more.
                    # Its children leave on their own (their parent is gone).
                    if not psutil.pid_exists(self.pgid) or _is_zombie(self.pgid):
                        self._rc = -1
        return self._rc


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """One ``python -m ...forkserver`` process; spawns workers on request (JSON lines)."""

    def __init__(self, python: str, env: Dict[str, str], log_path: str):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self._mu = threading.Lock()
        self.proc = subprocess.Popen(
            [python, "-m", "sglang_disagg_ext.selftest.harness.forkserver"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
        )
        hello = self._read_reply(FORKSERVER_START_S)
        if hello.get("ready") is not True:
            raise ForkServerError(f"fork server did not start: {hello}")
        self.hello = hello

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read_reply(self, timeout: float) -> Dict:
        end = time.monotonic() + timeout
        line = b""
        fd = self.proc.stdout.fileno()
        while not line.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
                raise ForkServerError(f"no reply from the fork server (exit {self.proc.poll()}); log {self.log_path}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ForkServerError(f"fork server closed its pipe (exit {self.proc.poll()}); log {self.log_path}")
                line += chunk
        return json.loads(line.decode())

    def spawn(self, role: str, module: str, args: List[str], env: Dict[str, str], log_path: str,
              cwd: str) -> ForkedChild:
        request = {"module": module, "args": args, "env": env, "log": log_path, "cwd": cwd}
        with self._mu:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read_reply(REPLY_S)
        if "pid" not in reply:
            raise ForkServerError(f"fork server refused {role}: {reply}")
        return ForkedChild(role, int(reply["pid"]), log_path, self)

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()


_SERVERS: Dict[Tuple[str, str], ForkServer] = {}
_SERVERS_MU = threading.Lock()


def _server_for(python: str, env: Dict[str, str], workdir: str) -> Optional[ForkServer]:
    key = (python, env.get("PYTHONPATH", ""))
    with _SERVERS_MU:
        server = _SERVERS.get(key)
        if server is not None and server.alive():
            return server
        log = os.path.join(workdir, f"forkserver-{len(_SERVERS)}-{os.getpid()}.log")
        try:
            server = ForkServer(python, env, log)
        except (ForkServerError, OSError) as exc:
            print(f"[harness] fork server unavailable, starting workers fresh: {exc}", file=sys.stderr)
            return None
        _SERVERS[key] = server
        return server


def forkserver_enabled() -> bool:
    return os.environ.get(FORKSERVER_ENV, "1") != "0"


def spawn(role: str, python: str, module: str, args: List[str], env: Dict[str, str], log_path: str,
          cwd: str) -> _Handle:
    """Start ``python -m module args`` as worker ``role``: forked from a warm server when possible."""
    if forkserver_enabled():
        import tempfile

        server = _server_for(python, env, tempfile.gettempdir())
        if server is not None:
            try:
                return server.spawn(role, module, args, env, log_path, cwd)
            except (ForkServerError, OSError) as exc:
                print(f"[harness] fork server failed to spawn {role}, starting it fresh: {exc}", file=sys.stderr)
    return Child(role, [python, "-m", module, *args], env, log_path, cwd)


def stop_servers() -> None:
    with _SERVERS_MU:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


atexit.register(stop_servers)
