"""Multi-rank topologies: P prefill ranks -> D decode ranks, one process per rank.

``run_scenario`` sends a scenario with ``prefill_tp`` or ``decode_tp`` above 1
here. Every rank is a ``harness.worker`` child, as in the two-process case,
with ``--tp-rank``: the prefill ranks form one real gloo group of size P
(``tp_size=P``), the decode ranks one of size D, as SGLang's schedulers have
them (``shared/notes/cpu-transfer-env.md``, multi-rank). Prefill rank 0 runs
the bootstrap server; the other prefill ranks wait for it before they
register. Each rank's KV pool holds its share of the model's
``kv.head_num`` KV heads; decode ranks check every element of their heads
(``patterns.compare_kv_rank_buffer``).

The result is one ``ScenarioResult``: a request's prefill (decode) status is
Success only when every prefill (decode) rank reached Success, Failed when
every rank ended and one Failed, otherwise the first non-final state seen.
Per-rank details are in the mismatch and error lines, ``exit_codes`` and
``timings`` (keyed ``prefill0``, ``decode1``, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional

from .run import (
    _kill_all,
    RequestResult,
    ScenarioResult,
    _Child,
    _last_line,
    _read_json,
    _safe,
    child_env,
    default_timeout,
    find_free_port,
    pool_devices,
)
from .scenario import Scenario
from .transport import TransferOptions

FINAL = ("Success", "Failed")
SETUP_DEATH_GRACE_S = 3.0
TAIL_PER_RANK = 2000


def _split(name: str):
    role = name.rstrip("0123456789")
    return role, int(name[len(role):])


def rank_names(scn: Scenario) -> List[str]:
    return [f"prefill{r}" for r in range(scn.prefill_tp)] + [f"decode{d}" for d in range(scn.decode_tp)]


def run_ranks(
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
    options: Optional[TransferOptions] = None,
) -> ScenarioResult:
    """Like ``run_scenario``, for ``scenario.prefill_tp`` + ``scenario.decode_tp`` processes.

    ``options``: protocol, device, IB device for every rank (all ranks of a
    GPU run share the one GPU named).
    """
    scenario.validate()
    options = (options or TransferOptions()).validated()
    n_children = scenario.prefill_tp + scenario.decode_tp
    # Imports and gloo rendezvous of every rank share two cores.
    timeout_s = (
        default_timeout(scenario) + 15.0 * (n_children - 2) if timeout_s is None else float(timeout_s)
    )
    if keep_dir is None:
        keep_dir = bool(os.environ.get("SGLANG_HARNESS_KEEP"))
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    run_dir = tempfile.mkdtemp(prefix=f"ranks-{_safe(scenario.name)}-", dir=workdir)
    result = ScenarioResult(scenario=scenario.name, backend=backend, transfer=dataclasses.asdict(options))
    children: Dict[str, _Child] = {}
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
        done = {name: os.path.join(run_dir, f"{name}.done") for name in rank_names(scenario)}
        for name in rank_names(scenario):
            role, rank = _split(name)
            cmd = [
                exe, "-m", "sglang_disagg_ext.selftest.harness.worker",
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
            ] + options.worker_args()
            if role == "prefill":
                cmd += ["--peer-result", os.path.join(run_dir, "decode0.json")]
            else:
                ready = [os.path.join(run_dir, f"prefill{r}.json") for r in range(scenario.prefill_tp)]
                cmd += ["--ready-files", os.pathsep.join(ready)]
            children[name] = _Child(name, cmd, env, os.path.join(run_dir, f"{name}.log"), run_dir)
        _wait(children, run_dir, deadline)
        if any(c.poll() is None for c in children.values()):
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
        if keep_dir:
            result.run_dir = run_dir
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _wait(children: Dict[str, _Child], run_dir: str, deadline: float) -> None:
    """Wait for every rank; stop early once a rank died in setup (the rest would wait for it)."""
    dead_since = None
    while time.monotonic() < deadline:
        states = {name: c.poll() for name, c in children.items()}
        if all(v is not None for v in states.values()):
            return
        for name, code in states.items():
            if code is None:
                continue
            res = _read_json(os.path.join(run_dir, f"{name}.json")) or {}
            if not res or (res.get("error") and not res.get("requests")):
                dead_since = dead_since or time.monotonic()
        if dead_since is not None and time.monotonic() - dead_since > SETUP_DEATH_GRACE_S:
            return
        time.sleep(0.05)


def _combine(statuses: List[Optional[str]]) -> Optional[str]:
    if statuses and all(s == "Success" for s in statuses):
        return "Success"
    if statuses and all(s in FINAL for s in statuses):
        return "Failed"
    return next((s for s in statuses if s not in FINAL), None)


def _collect(result: ScenarioResult, scn: Scenario, run_dir: str, children: Dict[str, _Child]) -> None:
    names = rank_names(scn)
    side = {name: _read_json(os.path.join(run_dir, f"{name}.json")) or {} for name in names}
    for name, c in children.items():
        result.exit_codes[name] = c.proc.returncode
    tails = {"prefill": [], "decode": []}
    for name in names:
        if name in children:
            tails[_split(name)[0]].append(f"--- {name} ---\n{children[name].tail(TAIL_PER_RANK)}")
    result.prefill_log_tail = "\n".join(tails["prefill"])
    result.decode_log_tail = "\n".join(tails["decode"])
    p0, d0 = side.get("prefill0", {}), side.get("decode0", {})
    result.sglang_version = p0.get("sglang_version") or d0.get("sglang_version")
    result.backend_effective = p0.get("backend_effective") or d0.get("backend_effective")
    result.prefill_manager = p0.get("manager_class")
    result.decode_manager = d0.get("manager_class")
    result.classes = {name: side[name].get("classes", {}) for name in names}
    result.timings = {name: side[name].get("timings", {}) for name in names}
    result.engines = {name: side[name].get("engine") for name in names}
    result.pool_devices = {name: pool_devices(side[name]) for name in names}
    kv_args = p0.get("kv_args") or d0.get("kv_args") or {}
    result.state_layout = kv_args.get("state_layout")
    result.state_types = kv_args.get("state_types", [])
    errors = []
    for name in names:
        if side[name].get("error"):
            errors.append(f"{name}: {_last_line(side[name]['error'])}")
        elif name in children and not side[name]:
            errors.append(f"{name}: no result (exit code {children[name].proc.returncode})")
    if errors:
        result.error = "; ".join(([result.error] if result.error else []) + errors)
    reqs = {name: {r["index"]: r for r in side[name].get("requests", [])} for name in names}
    prefills = [n for n in names if n.startswith("prefill")]
    decodes = [n for n in names if n.startswith("decode")]
    for i in range(len(scn.requests)):
        rr = RequestResult(index=i, room=scn.room_of(i))
        per = {name: reqs[name].get(i, {}) for name in names}
        rr.prefill_status = _combine([per[n].get("status") for n in prefills])
        rr.decode_status = _combine([per[n].get("status") for n in decodes])
        secs = [per[n].get("seconds") for n in prefills if per[n].get("seconds") is not None]
        rr.prefill_seconds = max(secs) if secs else None
        secs = [per[n].get("seconds") for n in decodes if per[n].get("seconds") is not None]
        rr.decode_seconds = max(secs) if secs else None
        rr.bytes_verified = all(bool(per[n].get("bytes_verified", False)) for n in decodes)
        for n in decodes:
            if not per[n]:
                rr.mismatches.append(f"{n} did not verify this request (no result)")
            rr.mismatches += [f"{n}: {m}" for m in per[n].get("mismatches", [])]
        errs = [f"{n}: {per[n]['error']}" for n in names if per[n].get("error")]
        rr.error = "\n".join(errs) or None
        reasons = [f"{n}: {per[n]['failure_reason']}" for n in prefills if per[n].get("failure_reason")]
        rr.prefill_failure_reason = "; ".join(reasons) or None
        reasons = [f"{n}: {per[n]['failure_reason']}" for n in decodes if per[n].get("failure_reason")]
        rr.decode_failure_reason = "; ".join(reasons) or None
        rr.prefill_log = [f"{n}: {x}" for n in prefills for x in per[n].get("log", [])]
        rr.decode_log = [f"{n}: {x}" for n in decodes for x in per[n].get("log", [])]
        rr.thread_errors = [f"{n} {t}" for n in names for t in per[n].get("thread_errors", [])]
        rr.rank_status = {n: per[n].get("status") for n in names}
        rr.rank_phases = {n: per[n].get("phases", {}) for n in names}
        result.requests.append(rr)
