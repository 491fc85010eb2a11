"""The process layer: ports, GPUs, starting servers, waiting for ``/health``, stopping by PID.

Every server is started in its own session (``start_new_session``), so it leads
its own process group; its PID, start time, command, URL and log are written to
``<run dir>/run.json`` as soon as it starts. Stopping ends exactly the recorded
processes and their descendants: a recorded PID whose start time no longer
matches (the PID was reused) is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from sglang_disagg_ext.deploy import DeployError
from sglang_disagg_ext.deploy.commands import ServerSpec

RUN_FILE = "run.json"


class ServerDied(DeployError):
    def __init__(self, name: str, pid: int, returncode: int, log: Path, tail: str):
        self.name, self.pid, self.returncode, self.log = name, pid, returncode, log
        super().__init__(
            f"the {name} server (pid {pid}) exited with code {returncode} during start; "
            f"log: {log}\n--- last lines of {log.name} ---\n{tail}"
        )


class HealthTimeout(DeployError):
    def __init__(self, names: Sequence[str], urls: Sequence[str], timeout: float, logs: Sequence[Path]):
        self.names = list(names)
        listing = ", ".join(f"{n} ({u}, log {l})" for n, u, l in zip(names, urls, logs))
        super().__init__(f"no answer from /health within {timeout:g} s: {listing}")


# ---------------------------------------------------------------- ports and GPUs

def port_in_use(host: str, port: int) -> Optional[str]:
    """Why ``port`` cannot be bound on ``host`` (None when it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Servers set SO_REUSEADDR too, so a socket in TIME_WAIT does not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "already in use"
            return exc.strerror or str(exc)
    return None


def ephemeral_range() -> Tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(host: str, count: int, low: int = 20000) -> List[int]:
    """``count`` distinct ports free on ``host`` right now, below the kernel's ephemeral range.

    The one free-port helper of the project (deploy tools, the self-test harness).
    Below the ephemeral range because the servers' own ZMQ, NCCL/gloo, UCX and
    transfer-engine sockets take ephemeral ports, which could grab a port picked
    from that range before the server that was given it binds; from ``low`` up
    because Mooncake's handshake and TCP transport take about 12000-17999. Not
    above the ephemeral range either: SGLang derives further ports from a server's
    port (0.5.11: its gRPC port, which must stay below 65536).
    """
    import random

    lo, _ = ephemeral_range()
    pool = list(range(low, lo))
    chosen: List[int] = []
    if len(pool) >= 100:
        candidates = random.sample(pool, min(len(pool), 50 * count + 50))
        for port in candidates:
            if len(chosen) == count:
                break
            if port not in chosen and port_in_use(host, port) is None:
                chosen.append(port)
    if len(chosen) < count:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with contextlib.ExitStack() as stack:
            while len(chosen) < count:
                sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
                sock.bind((host, 0))  # held open until all are chosen, so they differ
                if sock.getsockname()[1] not in chosen:
                    chosen.append(sock.getsockname()[1])
    return chosen


# GPU listing tools, tried in this order; the first that lists a GPU gives the count.
# amd-smi is ROCm's current tool (ROCm 6+, it replaces rocm-smi); rocm-smi is kept for older
# ROCm installs that have no amd-smi. An AMD node is where mori-ext runs.
NVIDIA_SMI = ("nvidia-smi", ["-L"])
AMD_SMI = ("amd-smi", ["list"])
ROCM_SMI = ("rocm-smi", ["--showid"])
GPU_TOOLS = (NVIDIA_SMI, AMD_SMI, ROCM_SMI)

# ``nvidia-smi -L``: one line per GPU, "GPU 0: NVIDIA H100 ... (UUID: GPU-...)".
_NVIDIA_LINE = re.compile(r"^GPU (\d+):")
# ``amd-smi list``: one block per GPU opened by an unindented "GPU: 0" line, then indented
# "BDF:", "UUID:", ... lines (CPU blocks, where listed, open with "CPU: 0" and are not counted).
_AMD_SMI_LINE = re.compile(r"^GPU:\s*(\d+)\s*$")
# ``rocm-smi --showid``: several "GPU[0]<tabs>: Device ID: ..." lines per GPU between banner
# lines; a GPU is a distinct index.
_ROCM_SMI_LINE = re.compile(r"^GPU\[(\d+)\]")
_GPU_LINE = {"nvidia-smi": _NVIDIA_LINE, "amd-smi": _AMD_SMI_LINE, "rocm-smi": _ROCM_SMI_LINE}

# Which variables limit what a process sees: CUDA's, and on ROCm HIP's and ROCr's (HIP also
# honours CUDA_VISIBLE_DEVICES).
_VISIBLE_VARS = {
    "nvidia-smi": ("CUDA_VISIBLE_DEVICES",),
    "amd-smi": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
    "rocm-smi": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
}


def count_listed_gpus(tool: str, text: str) -> int:
    """Number of distinct GPU indices in the output of ``tool`` (see GPU_TOOLS for the forms)."""
    pattern = _GPU_LINE[tool]
    return len({m.group(1) for m in map(pattern.match, text.splitlines()) if m})


def _visible_limit(tool: str, count: int) -> Tuple[int, str]:
    shown = []
    for var in _VISIBLE_VARS[tool]:
        value = os.environ.get(var)
        if value is None:
            continue
        entries = [v for v in value.split(",") if v.strip() and v.strip() != "-1"]
        count = min(count, len(entries))
        shown.append(f"{var}={value!r}")
    return count, "".join(f", {s}" for s in shown)


def _run_gpu_tool(tool: str, args: List[str]) -> Tuple[Optional[int], str]:
    """(GPUs ``tool`` lists, or None where it could not be asked; what happened, for messages)."""
    exe = shutil.which(tool)
    what = " ".join([tool] + args)
    if exe is None:
        return None, f"{tool}: not on PATH"
    try:
        out = subprocess.run([exe] + args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{what}: failed ({exc})"
    if out.returncode != 0:
        return None, f"{what}: exited {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    count = count_listed_gpus(tool, out.stdout)
    return count, f"{what} lists {count}"


def gpu_count(tools: Sequence[Tuple[str, List[str]]] = GPU_TOOLS) -> Tuple[int, str]:
    """(number of GPUs visible, how that was found): NVIDIA through ``nvidia-smi -L``, AMD through
    ``amd-smi list`` or else ``rocm-smi --showid``; the first tool that lists a GPU counts, limited
    by the visibility variables of its platform. The text names every tool tried and what each
    said, so a refusal shows where the count came from (or that no tool was there). ``tools``
    narrows the search (the CUDA-only end-to-end tests ask for NVIDIA GPUs alone)."""
    tried = []
    for tool, args in tools:
        count, how = _run_gpu_tool(tool, args)
        if count:
            visible, shown = _visible_limit(tool, count)
            return visible, "; ".join(tried + [how + shown])
        tried.append(how)
    return 0, "; ".join(tried)


def http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def router_workers(url: str, timeout: float) -> Optional[set]:
    """URLs of the healthy workers ``sglang_router`` at ``url`` lists; None where it has no ``/workers``."""
    try:
        with urllib.request.urlopen(url + "/workers", timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return None if exc.code == 404 else set()
    except (urllib.error.URLError, OSError, ValueError):
        return set()
    workers = body.get("workers", []) if isinstance(body, dict) else []
    return {str(w.get("url", "")).rstrip("/") for w in workers
            if isinstance(w, dict) and w.get("is_healthy", True)}


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------- the run record

class RunRecord:
    """``<run dir>/run.json``: what this deployment started, rewritten after every start."""

    def __init__(self, run_dir: Path, data: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.data = data if data is not None else {"servers": []}

    @property
    def path(self) -> Path:
        return self.run_dir / RUN_FILE

    @property
    def servers(self) -> List[dict]:
        return self.data["servers"]

    def url_of(self, name: str) -> Optional[str]:
        for entry in self.servers:
            if entry["name"] == name:
                return entry["url"]
        return None

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, run_dir) -> "RunRecord":
        path = Path(run_dir) / RUN_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DeployError(f"{path} does not exist: not a run folder written by launch_pd") from None
        except json.JSONDecodeError as exc:
            raise DeployError(f"{path} is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("servers"), list):
            raise DeployError(f"{path} has no 'servers' list")
        return cls(Path(run_dir), data)


def _create_time(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class Launcher:
    """Starts servers into one run folder and stops them again."""

    def __init__(self, run_dir: Path, record: Optional[RunRecord] = None):
        self.run_dir = Path(run_dir)
        self.record = record or RunRecord(self.run_dir)
        self.procs: Dict[str, subprocess.Popen] = {}
        self.specs: Dict[str, ServerSpec] = {}

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def start(self, spec: ServerSpec, cwd: Optional[str] = None) -> subprocess.Popen:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path(spec.name)
        env = dict(os.environ)
        env.update(spec.env)
        with open(log, "ab") as log_file:
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.procs[spec.name] = proc
        self.specs[spec.name] = spec
        self.record.servers.append(
            {
                "name": spec.name,
                "pid": proc.pid,
                "create_time": _create_time(proc.pid),
                "url": spec.url,
                "argv": spec.argv,
                "env": spec.env,
                "log": str(log),
            }
        )
        self.record.save()
        return proc

    def wait_healthy(
        self,
        names: Iterable[str],
        timeout: float,
        poll_interval: float = 1.0,
        progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        """Return when every named server answers ``/health`` with 200.

        Raises ServerDied as soon as one exits, HealthTimeout at the deadline.
        """
        pending = list(names)
        deadline = time.monotonic() + timeout
        while True:
            for name in list(pending):
                proc, spec = self.procs[name], self.specs[name]
                returncode = proc.poll()
                if returncode is not None:
                    log = self.log_path(name)
                    raise ServerDied(name, proc.pid, returncode, log, log_tail(log))
                remaining = deadline - time.monotonic()
                if http_ok(spec.health_url, timeout=max(0.2, min(2.0, remaining))):
                    pending.remove(name)
                    if progress:
                        progress(f"{name} is healthy at {spec.url}")
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise HealthTimeout(
                    pending,
                    [self.specs[n].url for n in pending],
                    timeout,
                    [self.log_path(n) for n in pending],
                )
            time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))

    def wait_router_workers(
        self,
        name: str,
        worker_urls: Sequence[str],
        timeout: float,
        poll_interval: float = 0.5,
        progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        """Return when the router ``name`` lists every URL of ``worker_urls`` as a healthy worker.

        ``sglang_router`` answers ``/health`` before it has registered the workers it was
        started with (it adds them in the background), and routes nothing until then: its
        ``/workers`` says when they are in. A router without ``/workers`` (the in-tree load
        balancer, whose workers are fixed at start) is ready once it answers ``/health``.
        """
        proc, spec = self.procs[name], self.specs[name]
        deadline = time.monotonic() + timeout
        wanted = {u.rstrip("/") for u in worker_urls}
        while True:
            returncode = proc.poll()
            if returncode is not None:
                log = self.log_path(name)
                raise ServerDied(name, proc.pid, returncode, log, log_tail(log))
            listed = router_workers(spec.url, timeout=max(0.2, min(2.0, deadline - time.monotonic())))
            if listed is None or wanted <= listed:
                if progress and listed is not None:
                    progress(f"{name} routes to {', '.join(sorted(wanted))}")
                return
            if time.monotonic() >= deadline:
                raise HealthTimeout([name], [spec.url + "/workers"], timeout, [self.log_path(name)])
            time.sleep(poll_interval)

    def stop_all(self, grace: float = 15.0) -> List[str]:
        report = stop_recorded(self.record.servers, grace=grace)
        for proc in self.procs.values():  # reap our own children
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return report


# ---------------------------------------------------------------- stopping

def _group_members(pgid: int, not_before: float) -> list:
    """Processes in process group ``pgid`` started no earlier than ``not_before``."""
    import psutil

    members = []
    for proc in psutil.process_iter(["create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["create_time"] >= not_before - 1.0:
                members.append(proc)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def stop_recorded(entries: Sequence[dict], grace: float = 15.0) -> List[str]:
    """End each recorded server and its descendants: SIGTERM, then SIGKILL after ``grace`` s.

    Returns one line per entry saying what happened.
    """
    import psutil

    report, targets = [], []
    for entry in entries:
        name, pid, created = entry["name"], int(entry["pid"]), entry.get("create_time")
        procs = {}
        try:
            leader = psutil.Process(pid)
            if created is None or abs(leader.create_time() - created) >= 1.0:
                report.append(f"{name}: pid {pid} now belongs to another process; left alone")
                continue
            procs[pid] = leader
            with contextlib.suppress(psutil.Error):
                for child in leader.children(recursive=True):
                    procs[child.pid] = child
        except psutil.NoSuchProcess:
            leader = None
        if created is not None:
            # The server was started in its own session, so its descendants stay
            # in process group <pid>, also after the server itself has gone.
            # While any member lives, the kernel does not hand <pid> out again.
            members = _group_members(pid, created)
            if leader is None and any(m.pid == pid for m in members):
                members = []  # <pid> leads a new group: reused, not ours
            for member in members:
                procs.setdefault(member.pid, member)
        if not procs:
            report.append(f"{name}: pid {pid} had already exited")
            continue
        extra = len(procs) - (1 if leader is not None else 0)
        state = "running" if leader is not None else "already exited"
        report.append(f"{name}: stopping pid {pid} ({state}) and {extra} descendant(s)")
        targets.extend(procs.values())

    for proc in targets:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(targets, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, still = psutil.wait_procs(alive, timeout=5)
    if alive:
        report.append(f"killed {len(alive)} process(es) that ignored SIGTERM for {grace:g} s")
    for proc in still:
        report.append(f"pid {proc.pid} survived SIGKILL")
    return report
