"""Parent side of the transfer harness: start one prefill and one decode child.

    from sglang_disagg_ext.selftest.harness import run_scenario, scenario
    res = run_scenario(scenario.kv_only(), "mooncake")
    assert res.ok, res.describe()

The children are ``python -m sglang_disagg_ext.selftest.harness.worker`` processes, each
in its own session/process group, running against the SGLang installed in the
interpreter given (``sys.executable`` by default). Every wait is bounded; on
every exit path the parent kills exactly the processes it started (their
process groups) and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .scenario import Scenario
from .transport import TransferOptions, engine_env

LOG_TAIL_CHARS = 6000
# Mooncake's P2P handshake and TCP transport pick ports in about 12000-17999.
_AVOID = (12000, 17999)
_KEEP_ENV = "SGLANG_HARNESS_KEEP"
# Env that must not leak from the parent into stock runs (registration.py).
_STRIP_ENV = ("SGLANG_DISAGG_EXT_BACKEND", "SGLANG_HARNESS_TAMPER")


@dataclasses.dataclass
class RequestResult:
    index: int
    room: int
    prefill_status: Optional[str] = None  # a KVPoll name; a non-final one means the side timed out there
    decode_status: Optional[str] = None
    prefill_seconds: Optional[float] = None  # from send() to the final state
    decode_seconds: Optional[float] = None  # from send_metadata() to the final state
    bytes_verified: bool = False
    mismatches: List[str] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    prefill_failure_reason: Optional[str] = None
    decode_failure_reason: Optional[str] = None
    prefill_log: List[str] = dataclasses.field(default_factory=list)  # WARNING+ records during the request
    decode_log: List[str] = dataclasses.field(default_factory=list)
    thread_errors: List[str] = dataclasses.field(default_factory=list)
    rank_status: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)  # multi-rank: per rank
    # multi-rank: per rank, the wall-clock times (time.time()) at which it left
    # the rank barrier, had its sender/receiver, was bootstrapped (prefill) or
    # sent its metadata (decode); describe() shows them against the earliest.
    rank_phases: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def success(self) -> bool:
        return self.prefill_status == "Success" and self.decode_status == "Success"

    @property
    def ok(self) -> bool:
        return self.success and self.bytes_verified and not self.error

    @property
    def timed_out(self) -> bool:
        final = ("Success", "Failed")
        return self.prefill_status not in final or self.decode_status not in final


@dataclasses.dataclass
class ScenarioResult:
    scenario: str
    backend: str
    sglang_version: Optional[str] = None
    backend_effective: Optional[str] = None
    prefill_manager: Optional[str] = None  # "module.Class" of the manager each side actually got
    decode_manager: Optional[str] = None
    classes: Dict[str, Dict[str, str]] = dataclasses.field(default_factory=dict)
    requests: List[RequestResult] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    wall_seconds: float = 0.0
    timings: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    state_layout: Optional[str] = None
    state_types: List[str] = dataclasses.field(default_factory=list)
    exit_codes: Dict[str, Optional[int]] = dataclasses.field(default_factory=dict)
    killed: List[str] = dataclasses.field(default_factory=list)
    prefill_log_tail: str = ""
    decode_log_tail: str = ""
    run_dir: Optional[str] = None
    # What the run was asked for (protocol, device, ib_device) and, per role
    # (per rank in multi-rank runs), what each worker really built: its
    # engine report and the devices its pools live on.
    transfer: Dict[str, Any] = dataclasses.field(default_factory=dict)
    engines: Dict[str, Any] = dataclasses.field(default_factory=dict)
    pool_devices: Dict[str, Dict[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.requests) and all(r.ok for r in self.requests)

    @property
    def setup_failed(self) -> bool:
        """The run ended before any request reached either side (engine start, pools ...)."""
        return bool(self.error) and all(
            r.prefill_status is None and r.decode_status is None for r in self.requests
        )

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d

    def describe(self, logs: bool = True) -> str:
        """A multi-line report for assertion messages and the CLI."""
        lines = [
            f"scenario {self.scenario!r} backend {self.backend!r} (effective {self.backend_effective!r}) "
            f"SGLang {self.sglang_version} [{self.state_layout}] ok={self.ok} wall={self.wall_seconds:.1f}s",
            f"  managers: prefill={self.prefill_manager} decode={self.decode_manager}",
        ]
        if self.error:
            lines.append(f"  error: {self.error}")
        for r in self.requests:
            lines.append(
                f"  req {r.index} room {r.room}: prefill={r.prefill_status} ({_fmt_s(r.prefill_seconds)}) "
                f"decode={r.decode_status} ({_fmt_s(r.decode_seconds)}) bytes_verified={r.bytes_verified}"
            )
            for m in r.mismatches[:20]:
                lines.append(f"    mismatch: {m}")
            for label, reason in (("prefill", r.prefill_failure_reason), ("decode", r.decode_failure_reason)):
                if reason:
                    lines.append(f"    {label} failure: {reason}")
            if r.error:
                lines.append(f"    error: {r.error.strip().splitlines()[-1] if r.error.strip() else r.error}")
            for t in r.thread_errors[:5]:
                lines.append(f"    {t}")
            if r.rank_phases and not r.ok:
                t0 = min((v for ph in r.rank_phases.values() for v in ph.values()), default=0.0)
                for name, phases in r.rank_phases.items():
                    lines.append(f"    {name} at: " + " ".join(f"{k}=+{v - t0:.2f}s" for k, v in phases.items()))
        if logs and not self.ok:
            for label, tail in (("prefill", self.prefill_log_tail), ("decode", self.decode_log_tail)):
                if tail:
                    lines.append(f"  --- {label} log tail ---")
                    lines.extend("  " + x for x in tail[-2500:].splitlines())
        return "\n".join(lines)

    def row(self) -> Dict[str, Any]:
        """One table row (the CLI's selftest table)."""
        return {
            "scenario": self.scenario,
            "backend": self.backend,
            "sglang": self.sglang_version,
            "prefill": ",".join(str(r.prefill_status) for r in self.requests) or "-",
            "decode": ",".join(str(r.decode_status) for r in self.requests) or "-",
            "bytes": "ok" if self.requests and all(r.bytes_verified for r in self.requests) else "BAD",
            "seconds": round(self.wall_seconds, 1),
            "result": "PASS" if self.ok else "FAIL",
        }


def _fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}s"


def format_table(results: Sequence[ScenarioResult]) -> str:
    rows = [r.row() for r in results]
    if not rows:
        return ""
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    out = ["  ".join(c.ljust(width[c]) for c in cols)]
    out.append("  ".join("-" * width[c] for c in cols))
    out += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(out)


# -- ports ---------------------------------------------------------------------------


def ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port(rng: Optional[random.Random] = None, attempts: int = 200) -> int:
    """A port outside the kernel's ephemeral range (ZMQ, UCX and gloo take those)
    and outside Mooncake's handshake range, that binds on 127.0.0.1 right now."""
    rng = rng or random.Random()
    lo, hi = ephemeral_range()
    candidates = [(20000, lo - 1)] if lo > 20001 else []
    if hi < 64999:
        candidates.append((hi + 1, 65000))
    candidates = [(a, b) for a, b in candidates if b > a] or [(20000, 30000)]
    for _ in range(attempts):
        a, b = rng.choice(candidates)
        port = rng.randint(a, b)
        if _AVOID[0] <= port <= _AVOID[1] or lo <= port <= hi:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


# -- processes -------------------------------------------------------------------------


def _repo_root() -> str:
    """The folder that holds the ``sglang_disagg_ext`` package (a checkout or site-packages)."""
    import sglang_disagg_ext

    return os.path.dirname(os.path.dirname(os.path.abspath(sglang_disagg_ext.__file__)))


def child_env(
    scn: Scenario, extra: Optional[Dict[str, str]] = None, options: Optional[TransferOptions] = None
) -> Dict[str, str]:
    from .sglang_setup import transfer_env  # pure: no SGLang import at module level

    options = options or TransferOptions()
    _, unset = engine_env(options)
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV and k not in unset}
    env.update(transfer_env(scn.timeouts, options=options))
    root = _repo_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if extra:
        env.update(extra)
    return env


class _Child:
    def __init__(self, role: str, cmd: List[str], env: Dict[str, str], log_path: str, cwd: str):
        self.role = role
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pgid = self.proc.pid  # start_new_session: the child leads its own session and group
        self.killed = False

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def _group_alive(self) -> bool:
        """Any process left in our child's session/group (e.g. after the leader exited)."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            # fields[2] = pgrp, fields[3] = session
            if int(fields[2]) == self.pgid and int(fields[3]) == self.pgid:
                return True
        return False

    def kill(self) -> bool:
        """SIGKILL the child's process group if anything of it is still there."""
        did = False
        if self.proc.poll() is None or self._group_alive():
            try:
                os.killpg(self.pgid, signal.SIGKILL)
                did = True
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd
            pass
        self.killed = self.killed or did
        return did

    def close(self) -> None:
        try:
            self._log.close()
        except OSError:
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


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def default_timeout(scn: Scenario) -> float:
    t = scn.timeouts
    return t.startup_s + len(scn.requests) * (t.request_s + 2.0) + 20.0


def run_scenario(
    scenario: Scenario,
    backend: str,
    timeout_s: Optional[float] = None,
    *,
    load_plugin: str = "auto",
    python: Optional[str] = None,
    keep_dir: Optional[bool] = None,
    extra_env: Optional[Dict[str, str]] = None,
    workdir: Optional[str] = None,
    decode_backend: Optional[str] = None,
    protocol: str = "tcp",
    device: str = "cpu",
    ib_device: Optional[str] = None,
) -> ScenarioResult:
    """Run ``scenario`` prefill -> decode through ``backend`` in two child processes.

    ``backend`` is the name given to ``--disaggregation-transfer-backend``
    (``"mooncake"``, ``"mooncake-ext"`` ...). ``load_plugin``: "auto" loads
    ``sglang_disagg_ext.registration.load_plugin`` in the children for -ext
    names only, "yes" always, "no" never. ``python``: the interpreter (and so
    the SGLang release) the children run; default ``sys.executable``.
    ``timeout_s`` bounds the whole run (default from the scenario's timeouts).
    ``keep_dir``: keep the run directory (logs, results); default: only when
    ``$SGLANG_HARNESS_KEEP`` is set. ``decode_backend``: a different backend
    name for the decode child (mixed-peer runs, e.g. ``mori-ext`` prefill with
    a stock ``mori`` decode); default ``backend``. ``protocol`` (tcp, rdma),
    ``device`` (cpu, cuda, cuda:N), ``ib_device``: how the children start
    their engines and where they build their pools (``harness.transport``);
    an option that cannot be honoured ends the run with an error naming it.
    """
    scenario.validate()
    options = TransferOptions(protocol, device, ib_device).validated()
    if getattr(scenario, "multi_rank", False):  # prefill_tp / decode_tp > 1: one process per rank
        from .ranks import run_ranks

        return run_ranks(
            scenario, backend, timeout_s, load_plugin=load_plugin, python=python, keep_dir=keep_dir,
            extra_env=extra_env, workdir=workdir, decode_backend=decode_backend, options=options,
        )
    timeout_s = default_timeout(scenario) if timeout_s is None else float(timeout_s)
    if keep_dir is None:
        keep_dir = bool(os.environ.get(_KEEP_ENV))
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    run_dir = tempfile.mkdtemp(prefix=f"harness-{_safe(scenario.name)}-", dir=workdir)
    result = ScenarioResult(scenario=scenario.name, backend=backend, transfer=dataclasses.asdict(options))
    children: Dict[str, _Child] = {}
    try:
        model_dir = os.path.join(run_dir, "model")
        os.makedirs(model_dir)
        from .sglang_setup import model_config_json

        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(model_config_json(scenario), f)
        scn_path = os.path.join(run_dir, "scenario.json")
        with open(scn_path, "w") as f:
            f.write(scenario.to_json())
        port = find_free_port()
        env = child_env(scenario, extra_env, options)
        done_files = {role: os.path.join(run_dir, f"{role}.done") for role in ("prefill", "decode")}
        exe = python or sys.executable
        for role in ("prefill", "decode"):
            cmd = [
                exe, "-m", "sglang_disagg_ext.selftest.harness.worker",
                "--role", role,
                "--scenario", scn_path,
                "--backend", decode_backend if role == "decode" and decode_backend else backend,
                "--bootstrap-port", str(port),
                "--model-dir", model_dir,
                "--dist-init", "file://" + os.path.join(run_dir, f"{role}.dist"),
                "--result", os.path.join(run_dir, f"{role}.json"),
                "--done-file", done_files[role],
                "--done-files", os.pathsep.join(done_files.values()),
                "--load-plugin", load_plugin,
                "--max-seconds", str(round(timeout_s + 15.0, 1)),
            ] + options.worker_args()
            if role == "prefill":
                cmd += ["--peer-result", os.path.join(run_dir, "decode.json")]
            children[role] = _Child(role, cmd, env, os.path.join(run_dir, f"{role}.log"), run_dir)

        _wait_children(children, run_dir, deadline, scenario)
        if time.monotonic() >= deadline and any(c.poll() is None for c in children.values()):
            result.error = f"harness deadline of {timeout_s:.0f}s passed; children killed"
    except BaseException as e:  # includes KeyboardInterrupt: still kill below
        result.error = f"{type(e).__name__}: {e}"
        if not isinstance(e, Exception):
            _kill_all(children, result)
            raise
    finally:
        _kill_all(children, result)
        result.wall_seconds = round(time.monotonic() - t0, 2)
        _collect(result, scenario, run_dir, children)
        for c in children.values():
            c.close()
        if keep_dir or result.run_dir:
            result.run_dir = run_dir
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:40]


def _wait_children(children: Dict[str, _Child], run_dir: str, deadline: float, scn: Scenario) -> None:
    """Wait for both children, bounded by ``deadline``; stop early when one side
    is gone and the other can only wait out its own timeouts.

    * prefill gone before decode finished: decode can still finish what is in
      flight, so it gets SGLang's waiting timeout plus a margin (3 s when the
      prefill never got to its requests);
    * decode gone first: nobody consumes prefill's work; 3 s.
    """
    gone_since: Dict[str, float] = {}
    while time.monotonic() < deadline:
        states = {role: c.poll() for role, c in children.items()}
        if all(v is not None for v in states.values()):
            return
        now = time.monotonic()
        for role, rc in states.items():
            if rc is not None:
                gone_since.setdefault(role, now)
        if "decode" in gone_since and states["prefill"] is None:
            if now - gone_since["decode"] > 3.0:
                return
        if "prefill" in gone_since and states["decode"] is None:
            res = _read_json(os.path.join(run_dir, "prefill.json")) or {}
            grace = 3.0 if not res.get("requests") else scn.timeouts.sglang_waiting_s + 5.0
            if now - gone_since["prefill"] > grace:
                return
        time.sleep(0.05)


def _kill_all(children: Dict[str, _Child], result: ScenarioResult) -> None:
    for role, c in children.items():
        if c.kill() and role not in result.killed:
            result.killed.append(role)


def _collect(result: ScenarioResult, scn: Scenario, run_dir: str, children: Dict[str, _Child]) -> None:
    side = {role: _read_json(os.path.join(run_dir, f"{role}.json")) or {} for role in ("prefill", "decode")}
    for role, c in children.items():
        result.exit_codes[role] = c.proc.returncode
        setattr(result, f"{role}_log_tail", c.tail())
    p, d = side["prefill"], side["decode"]
    result.sglang_version = p.get("sglang_version") or d.get("sglang_version")
    result.backend_effective = p.get("backend_effective") or d.get("backend_effective")
    result.prefill_manager = p.get("manager_class")
    result.decode_manager = d.get("manager_class")
    result.classes = {role: side[role].get("classes", {}) for role in side}
    result.timings = {role: side[role].get("timings", {}) for role in side}
    result.engines = {role: side[role].get("engine") for role in side}
    result.pool_devices = {role: pool_devices(side[role]) for role in side}
    kv_args = p.get("kv_args") or d.get("kv_args") or {}
    result.state_layout = kv_args.get("state_layout")
    result.state_types = kv_args.get("state_types", [])
    errors = []
    for role in ("prefill", "decode"):
        if side[role].get("error"):
            errors.append(f"{role}: {_last_line(side[role]['error'])}")
        elif role in children and not side[role]:
            errors.append(f"{role}: no result (exit code {children[role].proc.returncode})")
    if errors:
        result.error = "; ".join(([result.error] if result.error else []) + errors)
    preqs = {r["index"]: r for r in p.get("requests", [])}
    dreqs = {r["index"]: r for r in d.get("requests", [])}
    for i in range(len(scn.requests)):
        pr, dr = preqs.get(i, {}), dreqs.get(i, {})
        rr = RequestResult(index=i, room=scn.room_of(i))
        rr.prefill_status = pr.get("status")
        rr.decode_status = dr.get("status")
        rr.prefill_seconds = pr.get("seconds")
        rr.decode_seconds = dr.get("seconds")
        rr.bytes_verified = bool(dr.get("bytes_verified", False))
        rr.mismatches = list(dr.get("mismatches", []))
        if not dr:
            rr.mismatches.append("decode did not verify this request (no decode result)")
        errs = [f"{role}: {x['error']}" for role, x in (("prefill", pr), ("decode", dr)) if x.get("error")]
        rr.error = "\n".join(errs) or None
        rr.prefill_failure_reason = pr.get("failure_reason")
        rr.decode_failure_reason = dr.get("failure_reason")
        rr.prefill_log = pr.get("log", [])
        rr.decode_log = dr.get("log", [])
        rr.thread_errors = [f"prefill {t}" for t in pr.get("thread_errors", [])] + [
            f"decode {t}" for t in dr.get("thread_errors", [])
        ]
        result.requests.append(rr)


def pool_devices(worker_result: Dict[str, Any]) -> Dict[str, str]:
    """Pool name -> device, from one worker's result JSON."""
    return {p["name"]: p.get("device") for p in worker_result.get("pools", [])}


def _last_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1] if lines else str(text)
