"""Real SGLang servers on this CPU machine, for the real-server stage (``test/servers``). Test-only.

A PD pair is started, waited for and stopped by the project's own ``sglang-disagg-ext launch-pd``
(``--device cpu``), the colocated reference by ``deploy.procs.Launcher``; every process is stopped
by its PID (``launch-pd stop``, then a check that none is left). Servers run the stock
``python -m sglang.launch_server`` (the plugin's launcher on 0.5.10.post1) with
``test/support/cpu_server`` first on ``PYTHONPATH``: its ``sitecustomize`` holds the one-attribute
replacements stock SGLang needs to serve PD on a CPU, and the faults the tests arm.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import psutil

from support.plugin_metrics import SGLANG_LABELS

ROOT = Path(__file__).resolve().parents[2]
SHIM_DIR = ROOT / "test" / "support" / "cpu_server"
STUBS_DIR = ROOT / "scripts" / "cpu_stubs"
CLI = [sys.executable, "-m", "sglang_disagg_ext.cli"]

# A prefill chunk is 64 tokens; a page 16 where SGLang's paged allocator runs on a CPU
# (releases.features().paged_allocator_serves_cpu: 0.5.23), else 1 (0.5.11 launches Triton
# kernels for any larger page). PROMPTS below hold prompts of under one page of 16, of several
# pages, and one that needs four chunks.
CHUNK = 64


def page_size() -> int:
    from sglang_disagg_ext import releases

    return 16 if releases.features().paged_allocator_serves_cpu else 1


def server_flags(page: Optional[int] = None) -> List[str]:
    """The same flags on every server, PD or colocated, so that both compute the same numbers.
    No radix cache: a cached prefix would change how a prompt is computed between two runs.
    ``page``: the page size (default ``page_size()``, this release's)."""
    return ["--page-size", str(page or page_size()), "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096",
            "--mem-fraction-static", "0.05", "--disable-radix-cache", "--random-seed", "0", "--enable-metrics",
            "--log-level", "info"]
MAX_NEW_TOKENS = 24
PROMPTS = [
    "Hi",  # under one page
    "Question: 12 * 3?\nAnswer:",  # two pages
    "The quick brown fox jumps over the lazy dog. " * 2,  # six pages, two chunks
    "0 1 2 3 4 5 6 7 8 9 " * 12,  # 240 tokens: fifteen pages, four chunks
]
# Short SGLang timeouts (seconds) so that a fault ends every request within the test's bound.
# With SGLang's router retrying a failed request up to five times, a request whose prefill waits
# out its bootstrap timeout each time ends within 6 x 10 s.
TIMEOUT_S = 10
TIMEOUT_ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S),
}


def server_env(fault_dir: Optional[Path] = None, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment a server (and everything it starts) runs with."""
    env = dict(os.environ)
    path = os.pathsep.join([str(SHIM_DIR), str(STUBS_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update({
        "PYTHONPATH": path,
        # Idle schedulers busy-poll; three servers on two cores need every cycle.
        "OMP_NUM_THREADS": "1",
        # NIXL: UCX over TCP and shared memory on loopback.
        "UCX_TLS": "tcp,self,sm",
        "SGLANG_HOST_IP": "127.0.0.1",
        "SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX",
    })
    env.update(TIMEOUT_ENV)
    if fault_dir is not None:
        env["SGLANG_E2E_FAULT_DIR"] = str(fault_dir)
    env.update(extra or {})
    return env


# ------------------------------------------------------------------ HTTP

def post(url: str, body: dict, timeout: float) -> tuple:
    """(HTTP status, parsed JSON or text) of a POST; status 0 with the error where none came back."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (urllib.error.URLError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode(errors="replace")


def generate(url: str, prompt: str, timeout: float = 120.0, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple:
    """(status, body) of a greedy ``/generate``."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                "ignore_eos": True}}
    return post(url + "/generate", body, timeout)


def output_ids(url: str, prompt: str, timeout: float = 120.0) -> List[int]:
    status, body = generate(url, prompt, timeout)
    assert status == 200 and isinstance(body, dict), f"{url}/generate {prompt[:20]!r}: {status} {body}"
    return list(body["output_ids"])


def metric_values(text: str, name: str) -> Dict[str, float]:
    """``{label set: value}`` of every sample of ``name`` in a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def samples(text: str, prefix: str) -> List[Tuple[str, Dict[str, str], float]]:
    """``(name, labels, value)`` of every sample whose name starts with ``prefix``
    (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(prefix)]


def sglang_scheduler_labels(text: str) -> Dict[str, str]:
    """Those of ``SGLANG_LABELS`` on SGLang's own scheduler gauge ``sglang:num_running_reqs``."""
    found = {tuple((k, labels[k]) for k in SGLANG_LABELS if k in labels)
             for _, labels, _ in samples(text, "sglang:num_running_reqs")}
    assert len(found) == 1, f"SGLang's scheduler label sets: {found}"
    return dict(found.pop())


def total(text: str, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metric_values(text, name).items() if all(w in k for w in want))


# ------------------------------------------------------------------ processes

def _pids_alive(pids: Sequence[int]) -> List[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def tree_pids(pid: int) -> List[int]:
    try:
        proc = psutil.Process(pid)
        return [pid] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class PDPair:
    """A prefill + decode + router deployment made by ``launch-pd start --device cpu``."""

    def __init__(self, run_dir: Path, backend: str, model: str, fault_dir: Optional[Path] = None,
                 prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None, page: Optional[int] = None,
                 prefill_python: Optional[str] = None, decode_python: Optional[str] = None):
        self.run_dir, self.backend, self.model = Path(run_dir), backend, model
        self.page = page
        # Another environment's interpreter for a server (launch-pd --prefill-python/--decode-python).
        self.pythons = {"prefill": prefill_python, "decode": decode_python}
        self.fault_dir = fault_dir
        self.prefill_args, self.decode_args = list(prefill_args), list(decode_args)
        self.env = server_env(fault_dir, env)
        self.record: dict = {}
        self.pids: List[int] = []
        self.start_output = ""

    def launch_argv(self) -> List[str]:
        argv = CLI + ["launch-pd", "start", "--device", "cpu", "--model-path", self.model, "--backend", self.backend,
                      "--router", "sglang-router", "--run-dir", str(self.run_dir), "--timeout", "600",
                      "--server-args", shlex.join(server_flags(self.page))]
        for role, python in self.pythons.items():
            if python:
                argv += [f"--{role}-python", python]
        if self.backend.startswith("mooncake"):
            argv += ["--protocol", "tcp"]
        if self.prefill_args:
            argv += ["--prefill-args", shlex.join(self.prefill_args)]
        if self.decode_args:
            argv += ["--decode-args", shlex.join(self.decode_args)]
        return argv

    def start(self) -> "PDPair":
        done = subprocess.run(self.launch_argv(), capture_output=True, text=True, timeout=700, env=self.env,
                              cwd=str(ROOT))
        self.start_output = done.stdout + done.stderr
        if (self.run_dir / "run.json").exists():
            self.record = json.loads((self.run_dir / "run.json").read_text())
            self.pids = [s["pid"] for s in self.record["servers"]]
        if done.returncode != 0:
            raise AssertionError(f"launch-pd start ({self.backend}) exited {done.returncode}:\n{self.start_output}")
        return self

    def url(self, name: str) -> str:
        return next(s["url"] for s in self.record["servers"] if s["name"] == name)

    def pid(self, name: str) -> int:
        return next(s["pid"] for s in reversed(self.record["servers"]) if s["name"] == name)

    @property
    def router_url(self) -> str:
        return self.record["router_url"]

    def log(self, name: str) -> str:
        try:
            return (self.run_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def log_tails(self, lines: int = 30) -> str:
        return "\n".join(f"--- {name}.log ({self.backend}) ---\n" + "\n".join(self.log(name).splitlines()[-lines:])
                         for name in ("prefill", "decode", "router"))

    def alive(self, name: str) -> bool:
        return bool(_pids_alive([self.pid(name)]))

    def restart(self, name: str) -> str:
        done = subprocess.run(CLI + ["launch-pd", "restart", "--run-dir", str(self.run_dir), "--server", name,
                                     "--timeout", "600"],
                              capture_output=True, text=True, timeout=700, env=self.env, cwd=str(ROOT))
        self.record = json.loads((self.run_dir / "run.json").read_text())
        self.pids = sorted(set(self.pids) | {s["pid"] for s in self.record["servers"]})
        if done.returncode != 0:
            raise AssertionError(f"launch-pd restart {name} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout

    def wait_routed(self, timeout: float = 120.0) -> None:
        """Until the router lists prefill and decode as healthy workers again (it health-checks them)."""
        from sglang_disagg_ext.deploy.procs import router_workers

        wanted = {self.url("prefill"), self.url("decode")}
        deadline = time.monotonic() + timeout
        while True:
            listed = router_workers(self.router_url, timeout=2.0)
            if listed is None or wanted <= listed:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"router lists {listed}, not {wanted}, after {timeout:g} s\n{self.log_tails()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """``launch-pd stop``, then every PID it recorded (and their children) must be gone."""
        if not (self.run_dir / "run.json").exists():
            return
        record = json.loads((self.run_dir / "run.json").read_text())
        pids = sorted(set(self.pids) | {s["pid"] for s in record["servers"]})
        children = [c for p in pids for c in tree_pids(p)]
        subprocess.run(CLI + ["launch-pd", "stop", "--run-dir", str(self.run_dir), "--grace", "10"],
                       capture_output=True, text=True, timeout=120, env=self.env, cwd=str(ROOT))
        deadline = time.monotonic() + 20
        while _pids_alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _pids_alive(children)
        for pid in left:  # never leave a server behind, even when launch-pd stop failed
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        assert not left, f"launch-pd stop left processes running: {left}"


def start_pairs(pairs: Sequence[PDPair]) -> None:
    """Start several pairs at once (their starts overlap on two cores; each waits on its own)."""
    if not pairs:
        return
    with concurrent.futures.ThreadPoolExecutor(len(pairs)) as pool:
        errors = [f.exception() for f in [pool.submit(p.start) for p in pairs]]
    failed = [e for e in errors if e is not None]
    if failed:
        raise AssertionError("\n\n".join(str(e) for e in failed))


ACTIVATION = re.compile(r"sglang-disagg-ext \S+ active in this process \(pid (\d+), (\w+)\)")


def activation_lines(log: str) -> List[tuple]:
    """``(pid, manager class)`` of every activation line in a server log."""
    return [(int(m.group(1)), m.group(2)) for m in ACTIVATION.finditer(log)]


def stream(url: str, prompts: Sequence[str], concurrency: int, timeout: float) -> List[tuple]:
    """Send ``prompts`` with ``concurrency`` in flight; ``(status, body, seconds)`` per prompt, in order."""
    def one(prompt):
        t0 = time.monotonic()
        status, body = generate(url, prompt, timeout=timeout)
        return status, body, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def start_extra_prefill(pair: PDPair, run_dir: Path, page_size: int):
    """A second prefill server for ``pair``'s backend and model with another ``--page-size``,
    started by ``deploy.procs.Launcher`` (stop it with ``launcher.stop_all()``).
    Returns ``(launcher, url, bootstrap_port)``."""
    from sglang_disagg_ext.deploy import commands as cmds
    from sglang_disagg_ext.deploy.procs import Launcher, free_ports

    port, bootstrap = free_ports("127.0.0.1", 2)
    flags = server_flags()
    flags[flags.index("--page-size") + 1] = str(page_size)
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", pair.model,
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap),
            "--disaggregation-transfer-backend", pair.backend, "--host", "127.0.0.1", "--port", str(port)]
    argv += list(cmds.CPU_SERVER_ARGS) + flags
    env = {k: v for k, v in pair.env.items() if k not in os.environ or os.environ[k] != v}
    env.update(cmds.CPU_ENV)
    env.update(cmds.CPU_PREFILL_ENV)
    if pair.backend.startswith("mooncake"):
        env.update(cmds.TCP_ENV)
    launcher = Launcher(run_dir)
    launcher.start(cmds.ServerSpec("prefill", argv, cmds.base_url("127.0.0.1", port), port, env))
    return launcher, cmds.base_url("127.0.0.1", port), bootstrap


def router_add_prefill(router_url: str, url: str, bootstrap_port: int, timeout: float = 60.0) -> str:
    """Register a prefill in SGLang's router (its worker API); returns the worker id once it is listed."""
    from sglang_disagg_ext.deploy.procs import router_workers

    status, body = post(router_url + "/workers", {"url": url, "worker_type": "prefill",
                                                  "bootstrap_port": bootstrap_port}, timeout=10)
    assert status in (200, 202) and isinstance(body, dict), (status, body)
    deadline = time.monotonic() + timeout
    while url not in (router_workers(router_url, timeout=2.0) or set()):
        assert time.monotonic() < deadline, f"router never listed {url}"
        time.sleep(0.5)
    return body["worker_id"]


def router_remove_worker(router_url: str, worker_id: str) -> None:
    req = urllib.request.Request(f"{router_url}/workers/{worker_id}", method="DELETE")
    with urllib.request.urlopen(req, timeout=10):
        pass


def arm(fault_dir: Path, fault: str) -> None:
    (fault_dir / f"fired-{fault}").unlink(missing_ok=True)
    (fault_dir / fault).write_text("armed\n")


def fired(fault_dir: Path, fault: str) -> bool:
    return (fault_dir / f"fired-{fault}").exists()


# ------------------------------------------------------------------ checks shared by test modules

def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_tokens_equal(deployment, pair) -> None:
    """Every prompt's greedy ids through ``pair``'s router equal the colocated server's."""
    for prompt in PROMPTS:
        want = deployment.reference(prompt)
        got = output_ids(pair.router_url, prompt)
        assert len(want) == MAX_NEW_TOKENS
        assert got == want, (f"{pair.backend}, prompt {prompt[:24]!r} ({len(prompt)} chars): first difference at "
                             f"token {_first_difference(got, want)}\nPD        {got}\ncolocated {want}\n"
                             + pair.log_tails())
    # Greedy output that repeats one token would compare equal whatever KV arrived.
    assert all(len(set(deployment.reference(p))) >= 8 for p in PROMPTS), \
        {p[:16]: deployment.reference(p) for p in PROMPTS}


MANAGER_PREFIX = {"mooncake-ext": "MooncakeExt", "nixl-ext": "Nixl", "mori-ext": "Mori"}


def check_plugin_in_path(pair, policy, requests: int = 3) -> None:
    """From the running servers: the activation line logged by each server's live scheduler
    process (naming the manager class), the info metric, and the transfer counters and the
    duration histogram moving with ``requests`` requests, none failed."""
    backend = pair.backend
    before = {name: get_text(pair.url(name) + "/metrics") for name in ("prefill", "decode")}
    for prompt in PROMPTS[:requests]:
        output_ids(pair.router_url, prompt)
    time.sleep(1.0)  # decode counts once its scheduler polls the receiver to Success
    for role in ("prefill", "decode"):
        log = pair.log(role)
        schedulers = [c for c in tree_pids(pair.pid(role)) if c != pair.pid(role)]
        lines = [(pid, cls) for pid, cls in activation_lines(log) if pid in schedulers]
        assert len(lines) == 1, (f"{backend} {role}: activation lines {activation_lines(log)}, "
                                 f"scheduler pids {schedulers}\n{pair.log_tails()}")
        assert lines[0][1].startswith(MANAGER_PREFIX[backend]), lines
        assert f"{backend} -> " in log and "(pass-through)" not in log
        after = get_text(pair.url(role) + "/metrics")
        info = metric_values(after, "sglang_disagg_ext_info")
        assert len(info) == 1, info
        assert f'backend="{backend}"' in next(iter(info)) and f'sglang="{policy.version}"' in next(iter(info))

        def moved(name, **labels):
            return total(after, name, role=role, **labels) - total(before[role], name, role=role, **labels)

        assert moved("sglang_disagg_ext_transfers_total", outcome="success") == requests, (backend, role)
        assert moved("sglang_disagg_ext_transfers_total", outcome="failed") == 0
        assert moved("sglang_disagg_ext_transfer_duration_seconds_count") == requests
        # Both outcomes exist from the start, so a rate() has a baseline.
        plugin = samples(after, "sglang_disagg_ext_")
        assert {labels["outcome"] for name, labels, _ in plugin
                if name == "sglang_disagg_ext_transfers_total" and labels["role"] == role} == {"success", "failed"}
        # Every series of the plugin carries SGLang's own scheduler labels with SGLang's values
        # (read from SGLang's series on the same /metrics), so rules can join the two.
        theirs = sglang_scheduler_labels(after)
        assert theirs.get("engine_type") == role and "model_name" in theirs, theirs
        for name, labels, _ in plugin:
            assert {k: labels[k] for k in SGLANG_LABELS if k in labels} == theirs, (backend, role, name, labels)
