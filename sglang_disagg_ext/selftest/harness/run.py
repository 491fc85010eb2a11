"""Parent side of the transfer harness: start the prefill and decode workers of one scenario.

    from sglang_disagg_ext.selftest.harness import run_scenario, scenario
    res = run_scenario(scenario.kv_only(), "mooncake")
    assert res.ok, res.describe()

The workers are ``sglang_disagg_ext.selftest.harness.worker`` processes, one
per rank, each in its own session/process group, running against the SGLang
installed in the interpreter given (``sys.executable`` by default), forked
from a warm fork server where possible (``procs``). Every wait is bounded; on
every exit path the parent kills exactly the processes it started (their
process groups) and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .procs import Child, ForkedChild, spawn
from .scenario import MISMATCH_NOTICE_WAIT_S, Scenario
from .transport import TransferOptions, engine_env

FINAL = ("Success", "Failed")

_KEEP_ENV = "SGLANG_HARNESS_KEEP"
# Env that must not leak from the parent into stock runs (registration.py).
_STRIP_ENV = (
    "SGLANG_DISAGG_EXT_BACKEND", "SGLANG_DISAGG_EXT_BACKEND_PID", "SGLANG_HARNESS_DECODE_HOOK", "SGLANG_HARNESS_TAMPER",
    "SGLANG_HARNESS_PREFILL_HOOK",
)


@dataclasses.dataclass
class RequestResult:
    index: int
    room: int
    prefill_status: Optional[str] = None  # a KVPoll name; a non-final one means the side timed out there
    decode_status: Optional[str] = None
    prefill_seconds: Optional[float] = None  # from send() to the final state
    # from send_metadata() to the final state (decode_pending_queue: from the receiver's making,
    # for a request that never got to send_metadata)
    decode_seconds: Optional[float] = None
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
    # decode_pending_queue: how long each of decode's parallel-info tries held its stand-in
    # scheduler thread
    lookup_seconds: List[float] = dataclasses.field(default_factory=list)

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

    def failed_within(self, bound_s: float) -> bool:
        """Both sides reached Failed, each with a reason, within ``bound_s`` of their start."""
        return (
            self.prefill_status == "Failed"
            and self.decode_status == "Failed"
            and bool(self.prefill_failure_reason)
            and bool(self.decode_failure_reason)
            and self.prefill_seconds is not None
            and self.decode_seconds is not None
            and self.prefill_seconds <= bound_s
            and self.decode_seconds <= bound_s
        )


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
    # Per worker: "forked" (from the warm fork server) or "fresh" (a new interpreter), and its PID.
    launch: Dict[str, str] = dataclasses.field(default_factory=dict)
    # Per worker: the plugin's INFO lines (its activation line), as a server logs them.
    plugin_log: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    # Per process: its sglang_disagg_ext_* Prometheus metrics (text format) when the run ended.
    plugin_metrics: Dict[str, str] = dataclasses.field(default_factory=dict)
    pids: Dict[str, int] = dataclasses.field(default_factory=dict)
    # Per worker: the ranks SGLang itself computed there (``sglang_setup.sglang_ranks``).
    sglang_ranks: Dict[str, Dict[str, Optional[int]]] = dataclasses.field(default_factory=dict)
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
    # Wave runs (``Scenario.wave``): per worker, each wave's size, seconds and (decode)
    # writes found on pages no request of the wave targeted; per worker, the threads
    # alive when its first wave began that were gone after a later one; prefill's
    # dropped-write fault (``harness.faults``) and how many engine calls it failed.
    waves: Dict[str, List[Dict[str, Any]]] = dataclasses.field(default_factory=dict)
    threads_died: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    # Per worker: every exception that ended one of its threads, whenever it happened (each
    # request's ``thread_errors`` holds only those from its own start on).
    thread_errors: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    dropped_writes: Optional[Dict[str, Any]] = None
    # Per prefill worker: what its test hook reported (``worker._run_prefill_hook``), where it reports.
    prefill_hook_reports: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.requests) and all(r.ok for r in self.requests)

    def first_room_failed_then_served(self, prefill_status: str, decode_reason: str, within_s: float) -> bool:
        """Two requests: the first ended ``prefill_status`` on prefill and Failed on decode with exactly
        ``decode_reason`` within ``within_s`` (told, not a timeout), nothing written outside its pages;
        the second ok with every byte checked (the thread that met the fault served it); no thread died."""
        if self.error or len(self.requests) != 2:
            return False
        bad, good = self.requests
        return (
            (bad.prefill_status, bad.decode_status) == (prefill_status, "Failed")
            and bad.decode_failure_reason == decode_reason
            and bad.decode_seconds is not None and bad.decode_seconds < within_s
            and not any("must be untouched" in m for m in bad.mismatches)
            and good.ok
            and not any(r.thread_errors for r in self.requests)
        )

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


def find_free_port() -> int:
    """One port free on 127.0.0.1, outside the ephemeral and Mooncake ranges (``deploy.procs.free_ports``)."""
    from sglang_disagg_ext.deploy.procs import free_ports

    return free_ports("127.0.0.1", 1)[0]


# -- processes -------------------------------------------------------------------------


def _repo_root() -> str:
    """The folder that holds the ``sglang_disagg_ext`` package (a checkout or site-packages)."""
    import sglang_disagg_ext

    return os.path.dirname(os.path.dirname(os.path.abspath(sglang_disagg_ext.__file__)))


def fault_hooks_path() -> Optional[str]:
    """Path of the test-only manager fault hooks (``test/support/prefill_faults.py``: F8, F11 and
    MoRI status-worker rows), or None outside a source checkout.

    They make one SGLang method raise in a worker; nothing a well-formed request does makes stock
    raise there, so the rows need them, and they are not in the wheel.
    """
    path = os.path.join(_repo_root(), "test", "support", "prefill_faults.py")
    return path if os.path.isfile(path) else None


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


# Kept for bench/transfer.py: a worker in a fresh interpreter.
_Child = Child

WORKER_MODULE = "sglang_disagg_ext.selftest.harness.worker"
SETUP_DEATH_GRACE_S = 3.0
TAIL_PER_RANK = 2000


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def default_timeout(scn: Scenario) -> float:
    """The whole run's bound: startup, every request (wave), and 15 s per process beyond two
    (imports and gloo rendezvous of every rank share two cores)."""
    t = scn.timeouts
    n_children = scn.prefill_tp + scn.decode_tp
    # A wave's requests run side by side: each wave is bounded like one request.
    restart = t.startup_s if scn.restart_decode_in_wave is not None else 0.0
    restart += 15.0 if scn.has_mismatched_peer else 0.0  # one more process starting
    delays = sum(r.decode_metadata_delay_s for r in scn.requests)
    return (t.startup_s + len(scn.waves()) * (t.request_s + 2.0) + 20.0 + 15.0 * (n_children - 2) + restart
            + delays)


def rank_names(scn: Scenario) -> List[str]:
    """Worker names: ``prefill``/``decode`` for one rank a side, else ``prefill0``, ``decode1`` ..."""
    if not scn.multi_rank:
        return ["prefill", "decode"]
    return [f"prefill{r}" for r in range(scn.prefill_tp)] + [f"decode{d}" for d in range(scn.decode_tp)]


# The decode process the harness starts after the first one killed itself
# (``Scenario.restart_decode_in_wave``).
RESTARTED_DECODE = "decode-restarted"
# The second decode process beside the first, serving the mismatched-peer requests
# (``Scenario.mismatched_decode_kv_head_dim``).
MISMATCHED_DECODE = "decode-mismatched"
# Decode processes whose records join the first decode's (one record per request).
EXTRA_DECODES = (RESTARTED_DECODE, MISMATCHED_DECODE)


def _role_rank(name: str):
    base = name.split("-", 1)[0]  # "decode-restarted", "decode-mismatched": a decode, rank 0
    role = base.rstrip("0123456789")
    return role, int(base[len(role):] or 0)


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
    decode_python: Optional[str] = None,
    protocol: str = "tcp",
    device: str = "cpu",
    ib_device: Optional[str] = None,
) -> ScenarioResult:
    """Run ``scenario`` through ``backend``: ``prefill_tp`` prefill and ``decode_tp`` decode workers.

    ``backend`` is the name given to ``--disaggregation-transfer-backend``
    (``"mooncake"``, ``"mooncake-ext"`` ...). ``load_plugin``: "auto" loads
    ``sglang_disagg_ext.registration.load_plugin`` in the workers for -ext
    names only, "yes" always, "no" never. ``python``: the interpreter (and so
    the SGLang release) the workers run; default ``sys.executable``.
    ``timeout_s`` bounds the whole run (default from the scenario's timeouts).
    ``keep_dir``: keep the run directory (logs, results); default: only when
    ``$SGLANG_HARNESS_KEEP`` is set. ``decode_backend``: a different backend
    name for the decode workers (mixed-peer runs, e.g. ``mori-ext`` prefill with
    a stock ``mori`` decode); default ``backend``. ``decode_python``: the
    interpreter of the decode workers where it differs from ``python`` (a
    mixed-release pair: another venv, another SGLang release); default
    ``python``. ``protocol`` (tcp, rdma),
    ``device`` (cpu, cuda, cuda:N), ``ib_device``: how the workers start
    their engines and where they build their pools (``harness.transport``);
    an option that cannot be honoured ends the run with an error naming it.

    One rank a side is the 1x1 case of the same launcher: its workers are
    named ``prefill`` and ``decode``. With more, the prefill ranks form one
    real gloo group of size P, the decode ranks one of size D, as SGLang's
    schedulers have them; prefill rank 0 runs the bootstrap server; each
    rank's KV pool holds its share of the model's ``kv.head_num`` KV heads and
    decode ranks check every element of their heads. A request's prefill
    (decode) status is Success only when every prefill (decode) rank reached
    Success, Failed when every rank ended and one Failed, otherwise the first
    non-final state seen; per-rank details are in ``rank_status``, the mismatch
    and error lines, ``exit_codes`` and ``timings``.
    """
    scenario.validate()
    options = TransferOptions(protocol, device, ib_device).validated()
    timeout_s = default_timeout(scenario) if timeout_s is None else float(timeout_s)
    if keep_dir is None:
        keep_dir = bool(os.environ.get(_KEEP_ENV))
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    run_dir = tempfile.mkdtemp(prefix=f"harness-{_safe(scenario.name)}-", dir=workdir)
    result = ScenarioResult(scenario=scenario.name, backend=backend, transfer=dataclasses.asdict(options))
    children: Dict[str, Any] = {}
    names = rank_names(scenario)
    try:
        from .sglang_setup import model_config_json

        model_dir = os.path.join(run_dir, "model")
        os.makedirs(model_dir)
        config = model_config_json(scenario)
        # q heads must split over the larger TP size too (GQA: q heads >= KV heads).
        config["num_attention_heads"] = max(
            scenario.kv.head_num, scenario.prefill_tp, scenario.decode_tp, config["num_attention_heads"]
        )
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config, f)
        scn_path = os.path.join(run_dir, "scenario.json")
        with open(scn_path, "w") as f:
            f.write(scenario.to_json())
        port = find_free_port()
        env = child_env(scenario, extra_env, options)
        exe = python or sys.executable
        done = {name: os.path.join(run_dir, f"{name}.done") for name in names}
        if scenario.has_mismatched_peer:
            done[MISMATCHED_DECODE] = os.path.join(run_dir, f"{MISMATCHED_DECODE}.done")
        first_decode = next(n for n in names if n.startswith("decode"))
        prefills = [n for n in names if n.startswith("prefill")]
        for name in names:
            role, rank = _role_rank(name)
            args = [
                "--role", role,
                "--tp-rank", str(rank),
                "--scenario", scn_path,
                "--backend", decode_backend if role == "decode" and decode_backend else backend,
                "--bootstrap-port", str(port),
                "--model-dir", model_dir,
                "--dist-init", "file://" + os.path.join(run_dir, f"{role}.dist"),
                "--result", os.path.join(run_dir, f"{name}.json"),
                "--done-file", done[name],
                "--done-files", os.pathsep.join(done.values()),
                "--load-plugin", load_plugin,
                "--max-seconds", str(round(timeout_s + 15.0, 1)),
            ] + options.worker_args()
            if role == "prefill":
                args += ["--peer-result", os.path.join(run_dir, f"{first_decode}.json")]
            else:
                # Decode starts requests only once every prefill rank has its manager
                # and its test hook (SGLANG_HARNESS_PREFILL_HOOK) in place: without
                # this wait a single-rank decode's first pre-alloc message could reach
                # prefill's bootstrap thread before the hook, and the fault never fired
                # (the stock F8 bootstrap row once passed in CI on 0.5.12.post1).
                args += ["--ready-files", os.pathsep.join(os.path.join(run_dir, f"{p}.json") for p in prefills)]
            if role == "decode" and scenario.has_mismatched_peer:
                mismatched_args = _mismatched_decode_args(args, scenario, run_dir, done[MISMATCHED_DECODE])
            if role == "decode" and scenario.restart_decode_in_wave is not None:
                restart_args = args + ["--first-wave", str(scenario.restart_decode_in_wave + 1)]
                restart_args[restart_args.index("--result") + 1] = os.path.join(run_dir, f"{RESTARTED_DECODE}.json")
                args = args + ["--crash-in-wave", str(scenario.restart_decode_in_wave)]
            role_exe = decode_python if role == "decode" and decode_python else exe
            children[name] = spawn(name, role_exe, WORKER_MODULE, args, env, os.path.join(run_dir, f"{name}.log"), run_dir)

        if scenario.has_mismatched_peer:
            children[MISMATCHED_DECODE] = spawn(
                MISMATCHED_DECODE, decode_python or exe, WORKER_MODULE, mismatched_args, env,
                os.path.join(run_dir, f"{MISMATCHED_DECODE}.log"), run_dir)
        if scenario.restart_decode_in_wave is not None:
            _restart_decode_when_gone(children, deadline, lambda: spawn(
                RESTARTED_DECODE, decode_python or exe, WORKER_MODULE, restart_args, env,
                os.path.join(run_dir, f"{RESTARTED_DECODE}.log"), run_dir))
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


def _mismatched_decode_args(decode_args: List[str], scenario: Scenario, run_dir: str, done_file: str) -> List[str]:
    """The second decode's worker arguments: the first decode's, with its own scenario (its KV
    head dim), result, done file and process group, serving the mismatched-peer requests only."""
    args = list(decode_args)
    path = os.path.join(run_dir, f"{MISMATCHED_DECODE}.scenario.json")
    with open(path, "w") as f:
        f.write(scenario.mismatched_peer_scenario().to_json())
    for flag, value in (("--scenario", path), ("--result", os.path.join(run_dir, f"{MISMATCHED_DECODE}.json")),
                        ("--done-file", done_file),
                        ("--dist-init", "file://" + os.path.join(run_dir, f"{MISMATCHED_DECODE}.dist"))):
        args[args.index(flag) + 1] = value
    return args + ["--mismatched-peer"]


def _restart_decode_when_gone(children: Dict[str, Any], deadline: float, start) -> None:
    """Once the decode worker is gone (it kills itself mid-wave), start its successor:
    same arguments and done file (prefill waits for that), its own result file, from the
    next wave. Not when a prefill is gone first or the deadline passed."""
    while children["decode"].poll() is None:
        # Only a prefill gone matters: the second (mismatched) decode may end before this one.
        if time.monotonic() > deadline or any(c.poll() is not None for n, c in children.items()
                                              if n.startswith("prefill")):
            return
        time.sleep(0.02)
    children[RESTARTED_DECODE] = start()


def _wait_children(children: Dict[str, Any], run_dir: str, deadline: float, scn: Scenario) -> None:
    """Wait for every worker, bounded by ``deadline``; stop early when the rest can only
    wait out their own timeouts:

    * a worker died in setup (no result, or an error before any request): the
      others would wait for it; 3 s;
    * every decode gone while a prefill runs: nobody consumes prefill's work;
      ``Timeouts.decode_gone_s`` (3 s by default; ``MISMATCH_NOTICE_WAIT_S`` + 3 s once its requests are done: it may be counting
      decode's mismatch notices, and exits by itself);
    * every prefill gone while a decode runs: decode can still finish what is
      in flight, so it gets SGLang's waiting timeout plus a margin (3 s when
      the prefill never got to its requests).
    """
    gone_since: Dict[str, float] = {}
    setup_death = None
    while time.monotonic() < deadline:
        states = {name: c.poll() for name, c in children.items()}
        if all(v is not None for v in states.values()):
            return
        now = time.monotonic()
        results = {}
        for name, rc in states.items():
            if rc is None:
                continue
            gone_since.setdefault(name, now)
            res = results[name] = _read_json(os.path.join(run_dir, f"{name}.json")) or {}
            if not res or (res.get("error") and not res.get("requests")):
                setup_death = setup_death or now
        if setup_death is not None and now - setup_death > SETUP_DEATH_GRACE_S:
            return
        by_role: Dict[str, List[str]] = {"prefill": [], "decode": []}
        for name in states:
            by_role[_role_rank(name)[0]].append(name)
        alive = {role: any(states[n] is None for n in ns) for role, ns in by_role.items()}
        if not alive["decode"] and alive["prefill"]:
            # A prefill whose requests are done may still be counting decode's mismatch
            # notices (bounded by MISMATCH_NOTICE_WAIT_S): killed before its last result
            # write, its counts were lost (seen once in CI, under load, at NIXL TP 1 -> 2).
            # One still in its requests gets the short grace, as before.
            counting = all((_read_json(os.path.join(run_dir, f"{n}.json")) or {}).get("done")
                           for n in by_role["prefill"] if states[n] is None)
            grace = MISMATCH_NOTICE_WAIT_S + 3.0 if counting else scn.timeouts.decode_gone_s
            if now - max(gone_since[n] for n in by_role["decode"]) > grace:
                return
        if not alive["prefill"] and alive["decode"]:
            served = any(results.get(n, {}).get("requests") for n in by_role["prefill"])
            grace = scn.timeouts.sglang_waiting_s + 5.0 if served else 3.0
            if now - max(gone_since[n] for n in by_role["prefill"]) > grace:
                return
        time.sleep(0.05)


def _kill_all(children: Dict[str, Any], result: ScenarioResult) -> None:
    for role, c in children.items():
        if c.kill() and role not in result.killed:
            result.killed.append(role)


def _combine(statuses: List[Optional[str]]) -> Optional[str]:
    if statuses and all(s == "Success" for s in statuses):
        return "Success"
    if statuses and all(s in FINAL for s in statuses):
        return "Failed"
    return next((s for s in statuses if s not in FINAL), None)


def _merge_fault_reports(reports: List[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """The prefill ranks' engine-fault reports as one: calls failed and passed summed
    (each rank counts its own), the rest from the first rank that has one."""
    reports = [r for r in reports if r]
    if not reports:
        return None
    merged = dict(reports[0])
    for key in ("engine_calls_failed", "engine_calls_passed"):
        merged[key] = sum(r.get(key, 0) for r in reports)
    return merged


def _collect(result: ScenarioResult, scn: Scenario, run_dir: str, children: Dict[str, Any]) -> None:
    names = rank_names(scn)
    multi = scn.multi_rank
    side = {name: _read_json(os.path.join(run_dir, f"{name}.json")) or {} for name in names}
    for extra in EXTRA_DECODES:
        if extra not in children:
            continue
        record = _read_json(os.path.join(run_dir, f"{extra}.json"))
        result.exit_codes[extra] = children[extra].returncode
        result.pids[extra] = children[extra].pid
        if not record or record.get("error"):
            why = _last_line(record["error"]) if record else "no result"
            result.error = "; ".join(([result.error] if result.error else []) + [f"{extra}: {why}"])
        if record:
            # One decode record per request: the first process's, then its successor's or the
            # second decode's (each serves requests the first does not).
            side["decode"] = dict(side["decode"])
            side["decode"]["requests"] = side["decode"].get("requests", []) + record.get("requests", [])
            result.waves[extra] = record.get("waves", [])
            result.threads_died[extra] = record.get("threads_died", [])
    for name, c in children.items():
        result.exit_codes[name] = c.returncode
        result.launch[name] = "forked" if isinstance(c, ForkedChild) else "fresh"
        result.pids[name] = c.pid
    tails: Dict[str, List[str]] = {"prefill": [], "decode": []}
    for name in names:
        if name in children:
            role = _role_rank(name)[0]
            tails[role].append(f"--- {name} ---\n{children[name].tail(TAIL_PER_RANK)}" if multi else children[name].tail())
    result.prefill_log_tail = "\n".join(tails["prefill"])
    for extra in EXTRA_DECODES:
        if extra in children:
            tails["decode"].append(f"--- {extra} ---\n{children[extra].tail(TAIL_PER_RANK)}")
    result.decode_log_tail = "\n".join(tails["decode"])
    prefills = [n for n in names if n.startswith("prefill")]
    decodes = [n for n in names if n.startswith("decode")]
    p0, d0 = side[prefills[0]], side[decodes[0]]
    result.sglang_version = p0.get("sglang_version") or d0.get("sglang_version")
    result.backend_effective = p0.get("backend_effective") or d0.get("backend_effective")
    result.prefill_manager = p0.get("manager_class")
    result.decode_manager = d0.get("manager_class")
    result.classes = {name: side[name].get("classes", {}) for name in names}
    result.timings = {name: side[name].get("timings", {}) for name in names}
    result.engines = {name: side[name].get("engine") for name in names}
    result.plugin_log = {name: side[name].get("plugin_log", []) for name in names}
    result.plugin_metrics = {name: side[name].get("plugin_metrics", "") for name in names}
    result.pool_devices = {name: pool_devices(side[name]) for name in names}
    result.sglang_ranks = {name: side[name].get("sglang_ranks", {}) for name in names}
    result.waves.update({name: side[name]["waves"] for name in names if "waves" in side[name]})
    result.threads_died.update({name: side[name]["threads_died"] for name in names if "threads_died" in side[name]})
    result.thread_errors = {name: side[name].get("thread_errors", []) for name in names}
    result.dropped_writes = _merge_fault_reports([side[n].get("dropped_writes") for n in prefills])
    result.prefill_hook_reports = {n: side[n]["prefill_hook_report"] for n in prefills
                                   if "prefill_hook_report" in side[n]}
    kv_args = p0.get("kv_args") or d0.get("kv_args") or {}
    result.state_layout = kv_args.get("state_layout")
    result.state_types = kv_args.get("state_types", [])
    errors = []
    for name in names:
        if side[name].get("error"):
            errors.append(f"{name}: {_last_line(side[name]['error'])}")
        elif name in children and not side[name]:
            errors.append(f"{name}: no result (exit code {children[name].returncode})")
    if errors:
        result.error = "; ".join(([result.error] if result.error else []) + errors)
    reqs = {name: {r["index"]: r for r in side[name].get("requests", [])} for name in names}

    def tag(name: str, text: str) -> str:  # one rank a side: lines as the worker wrote them
        return f"{name}: {text}" if multi else text

    for i in range(len(scn.requests)):
        rr = RequestResult(index=i, room=scn.room_of(i))
        per = {name: reqs[name].get(i, {}) for name in names}
        rr.prefill_status = _combine([per[n].get("status") for n in prefills])
        rr.decode_status = _combine([per[n].get("status") for n in decodes])
        secs = [per[n].get("seconds") for n in prefills if per[n].get("seconds") is not None]
        rr.prefill_seconds = max(secs) if secs else None
        secs = [per[n].get("seconds") for n in decodes if per[n].get("seconds") is not None]
        rr.decode_seconds = max(secs) if secs else None
        rr.lookup_seconds = [x for n in decodes for x in per[n].get("lookup_seconds", [])]
        rr.bytes_verified = all(bool(per[n].get("bytes_verified", False)) for n in decodes)
        for n in decodes:
            if not per[n]:
                rr.mismatches.append(f"{n} did not verify this request (no {n} result)")
            rr.mismatches += [tag(n, m) for m in per[n].get("mismatches", [])]
        errs = [f"{n}: {per[n]['error']}" for n in names if per[n].get("error")]
        rr.error = "\n".join(errs) or None
        reasons = [tag(n, per[n]["failure_reason"]) for n in prefills if per[n].get("failure_reason")]
        rr.prefill_failure_reason = "; ".join(reasons) or None
        reasons = [tag(n, per[n]["failure_reason"]) for n in decodes if per[n].get("failure_reason")]
        rr.decode_failure_reason = "; ".join(reasons) or None
        rr.prefill_log = [tag(n, x) for n in prefills for x in per[n].get("log", [])]
        rr.decode_log = [tag(n, x) for n in decodes for x in per[n].get("log", [])]
        rr.thread_errors = [f"{n} {t}" for n in names for t in per[n].get("thread_errors", [])]
        rr.rank_status = {n: per[n].get("status") for n in names}
        rr.rank_phases = {n: per[n].get("phases", {}) for n in names}
        result.requests.append(rr)


def pool_devices(worker_result: Dict[str, Any]) -> Dict[str, str]:
    """Pool name -> device, from one worker's result JSON."""
    return {p["name"]: p.get("device") for p in worker_result.get("pools", [])}


def _last_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1] if lines else str(text)
