"""``sglang-disagg-ext selftest``: the built-in scenarios, stock vs ``-ext``, on the real engines.

An operator runs this on a node before switching the flag. Each row runs one
scenario with the stock backend name and with the ``-ext`` name and reports
whether each passed (bytes verified at the destination, sentinels untouched,
both sides in the expected final state). Exit status is non-zero if any
``-ext`` run fails.

``--protocol`` (tcp, rdma), ``--device`` (cpu, cuda, cuda:N) and
``--ib-device`` reach every worker process: pools are built on that device
and the engines started with that protocol (``harness.transport`` says what
each means per engine). An option this machine cannot honour ends the
command before any transfer (``--device cuda`` without CUDA, exit 2) or the
run fails with a message naming it (RDMA that cannot start: "RDMA init
failed ... ib device tried ..."), never a TCP or CPU result passed off as
the option asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
import warnings
from typing import Dict, List, Optional

from sglang_disagg_ext import __version__, releases, verification
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness.transport import TransferOptions, TransportOptionError
from sglang_disagg_ext.backend_table import BACKENDS
from sglang_disagg_ext.selftest.rows import format_table, make_row, progress_on_stderr, summary_line, totals

# Worker errors after which every further run of this selftest would fail the
# same way (the engine or the device cannot start here): later scenarios are
# reported, not run.
_ENGINE_START_FAILURES = ("RDMA init failed", "CUDA is not available")



def engine_start_failure(result) -> Optional[str]:
    """The error of a run whose workers could not start their engine or device, else None."""
    if result.setup_failed and any(m in (result.error or "") for m in _ENGINE_START_FAILURES):
        return result.error
    return None


def observed(result) -> Dict:
    """What the workers of one run report they built: engine transport(s) and pool devices.

    Mooncake reports the transport it installed (``transport``); NIXL the
    ``UCX_TLS`` its agent was created under.
    """
    transports, devices = set(), set()
    for report in result.engines.values():
        if report:
            value = report.get("transport") or (f"ucx:{report['ucx_tls']}" if report.get("ucx_tls") else None)
            if value:
                transports.add(value)
    for pools in result.pool_devices.values():
        devices.update(d for d in pools.values() if d)
    out = {"engine_transport": sorted(transports), "pool_devices": sorted(devices)}
    digests = digest_counts(result)
    if digests:
        out["digests"] = digests
    return out


def digest_counts(result) -> Dict[str, int]:
    """Rooms the run's decode workers checked against prefill's digest (``--verify``), by
    outcome (``ok``, ``unverified``, ``mismatch``), read from the workers' plugin metrics;
    empty where nothing was verified."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Dict[str, int] = {}
    for text in (getattr(result, "plugin_metrics", None) or {}).values():
        for family in text_string_to_metric_families(text or ""):
            for sample in family.samples:
                if sample.name == "sglang_disagg_ext_verified_transfers_total":
                    key = sample.labels.get("result", "?")
                elif sample.name == "sglang_disagg_ext_verify_mismatches_total":
                    key = "mismatch"
                else:
                    continue
                counts[key] = counts.get(key, 0) + int(sample.value)
    return counts


def not_run_row(name: str, fix: str, backend: str, why: str, **extra) -> Dict:
    """A row for a scenario skipped because an earlier run showed the engine cannot start here."""
    return make_row(name, fix, backend, "fail", "fail", False, 0.0, ext_detail=f"not run: {why}", **extra)


def ext_only_row(name: str, fix: str, backend: str, ext_ok: bool, ext, seconds: float) -> Dict:
    """A row of ``selftest --ext-only``: the -ext run alone, stock "not run" (never compared)."""
    return make_row(name, fix, backend, "not run", "pass" if ext_ok else "fail",
                    ext_ok and any(r.bytes_verified for r in ext.requests), seconds,
                    stock_detail="not run (--ext-only)",
                    ext_detail=None if ext_ok else ext.describe(logs=False), **observed(ext))


def mooncake_scenarios(policy) -> List:
    """Every Mooncake scenario that applies on ``policy``'s release, by fix (F1/F2, F6, F7, F8, F9)."""
    from sglang_disagg_ext.selftest.scenarios import isolation, mooncake, registration, state_pairing, thread_survival

    out = list(mooncake.scenarios_for(policy))
    for module in (isolation, state_pairing, thread_survival, registration):
        out += [s for s in module.SCENARIOS if s.applies(policy)]
    if isolation.DROPPED_WRITE.applies(policy):
        out.append(isolation.DROPPED_WRITE)
    return out


def prefill_fault_hooks() -> Optional[str]:
    """Path of the test-only fault hooks (``harness.run.fault_hooks_path``), or None outside a source checkout."""
    from sglang_disagg_ext.selftest.harness.run import fault_hooks_path

    return fault_hooks_path()


# Why a Mooncake scenario with a fault hook is "n/a" outside a source checkout (also ``--list``).
MOONCAKE_NO_HOOKS_WHY = ("no source checkout: the fault hook (test/support/prefill_faults.py) "
                         "that makes a transfer-path thread raise is not in the wheel")


def mooncake_hook_not_run_reason(builtin, hooks: Optional[str]) -> Optional[str]:
    """Why a Mooncake scenario is "n/a" here for want of its fault hook (``hooks``: the hook
    file, or None outside a source checkout), else None; one rule for the run and ``--list``."""
    return MOONCAKE_NO_HOOKS_WHY if getattr(builtin, "prefill_hook", "") and hooks is None else None


def mooncake_rows(policy, timeout_s: float, options: Optional[TransferOptions] = None,
                  names: Optional[List[str]] = None, ext_only: bool = False) -> List[Dict]:
    from sglang_disagg_ext.selftest.harness.run import run_scenario

    transfer = dataclasses.asdict(options or TransferOptions())
    rows = []
    start_failure = None
    hooks = prefill_fault_hooks()
    for builtin in mooncake_scenarios(policy):
        if names is not None and builtin.name not in names:
            continue
        if start_failure:
            rows.append(not_run_row(builtin.name, builtin.fix, "mooncake", start_failure))
            continue
        why = mooncake_hook_not_run_reason(builtin, hooks)
        if why:
            rows.append(make_row(builtin.name, builtin.fix, "mooncake", "n/a", "n/a", False, 0.0, why=why))
            continue
        hook = getattr(builtin, "prefill_hook", "")
        if hook:
            transfer_run = dict(transfer, extra_env={"SGLANG_HARNESS_PREFILL_HOOK": f"{hooks}:{hook}"})
        else:
            transfer_run = transfer
        start = time.monotonic()
        stock = None if ext_only else run_scenario(
            builtin.scenario_for(policy, "mooncake"), "mooncake", timeout_s=timeout_s, **transfer_run)
        ext = run_scenario(builtin.scenario_for(policy, "mooncake-ext"), "mooncake-ext", timeout_s=timeout_s,
                           **transfer_run)
        failure = engine_start_failure(ext) or (stock is not None and engine_start_failure(stock))
        if stock is None:
            rows.append(ext_only_row(builtin.name, builtin.fix, "mooncake", builtin.evaluate(ext), ext,
                                     time.monotonic() - start))
            if failure:
                start_failure = f"the engine did not start in scenario {builtin.name!r}: {failure}"
            continue
        if failure:
            start_failure = f"the engine did not start in scenario {builtin.name!r}: {failure}"
        stock_expected = builtin.stock_expectation(policy)
        stock_ok = builtin.evaluate(stock)
        # Where the bug is live, stock must fail *as the bug does* (its signature); a setup
        # error, harness error or deadline is reported, never counted as the reproduction.
        not_reproduced = builtin.stock_signature(stock, policy) if stock_expected == "fail" else None
        if stock_expected == "fail" and stock_ok:
            not_reproduced = "stock passed"
        rows.append(
            make_row(
                builtin.name,
                builtin.fix,
                "mooncake",
                "pass" if stock_ok else "fail",
                "pass" if builtin.evaluate(ext) else "fail",
                # Decode compared the pages byte for byte and they matched, and where the
                # bug is live stock showed it.
                any(r.bytes_verified for r in ext.requests) and not not_reproduced,
                time.monotonic() - start,
                stock_expected=stock_expected,
                stock_reproduced=(not_reproduced is None) if stock_expected == "fail" else None,
                stock_detail=not_reproduced,
                ext_detail=None if builtin.evaluate(ext) else ext.describe(logs=False),
                **observed(ext),
            )
        )
    return rows


# backend -> (module, function) providing that backend's rows (backend_table).

_ROW_SOURCES = {b.name: b.selftest_rows for b in BACKENDS}


def collect_rows(backends: List[str], timeout_s: float, options: Optional[TransferOptions] = None,
                 names: Optional[List[str]] = None, ext_only: bool = False) -> List[Dict]:
    """Every row for ``backends`` plus the F5 rows; ``names`` limits them to those scenarios.

    ``ext_only``: Mooncake and NIXL scenarios run with the -ext name only (MoRI's
    stand-in rows and the in-process F5 rows are unchanged: they are cheap).
    """
    options = (options or TransferOptions()).validated()
    policy = releases.current_policy()
    rows: List[Dict] = []
    for backend in backends:
        module_name, func_name = _ROW_SOURCES[backend]
        func = getattr(importlib.import_module(module_name), func_name)
        if backend == "mooncake":
            rows.extend(func(policy, timeout_s, options=options, names=names, ext_only=ext_only))
        elif backend == "nixl":
            rows.extend(func(timeout_s=timeout_s, names=names, options=options, ext_only=ext_only))
        else:
            rows.extend(func(options=options, names=names))
    from sglang_disagg_ext.selftest.scenarios.f5 import f5_row_names, f5_rows

    # F5 rows run in this process on pools of ``device``; they move no bytes
    # between processes, so the protocol does not apply to them.
    if names is None or set(names) & set(f5_row_names()):
        rows.extend(f5_rows(device=options.device, names=names))
    from sglang_disagg_ext.selftest.scenarios.metadata_gate import metadata_gate_row_names, metadata_gate_rows

    # F10 rows drive SGLang's decode transfer queue in this process (no transfer).
    if names is None or set(names) & set(metadata_gate_row_names()):
        rows.extend(metadata_gate_rows(names=names))
    return rows


def scenario_names(backends: List[str]) -> List[str]:
    """Every row name ``collect_rows`` can produce for ``backends`` on this release (runs nothing)."""
    from sglang_disagg_ext.selftest.scenarios.f5 import f5_row_names

    policy = releases.current_policy()
    names: List[str] = []
    if "mooncake" in backends:
        names += [b.name for b in mooncake_scenarios(policy)]
    if "nixl" in backends:
        from sglang_disagg_ext.selftest.scenarios.nixl_newest import nixl_scenarios

        names += [b.name for b in nixl_scenarios(policy)]
    if "mori" in backends:
        from sglang_disagg_ext.selftest.scenarios.mori import ROW_NAMES
        from sglang_disagg_ext.selftest.scenarios.mori_newest import ROW_NAMES as F12_ROW_NAMES

        names += list(ROW_NAMES) + list(F12_ROW_NAMES)
    from sglang_disagg_ext.selftest.scenarios.metadata_gate import metadata_gate_row_names

    return names + f5_row_names() + metadata_gate_row_names()


def list_rows(backends: List[str], options: Optional[TransferOptions] = None) -> List[Dict]:
    """``selftest --list --json``: one entry per row ``scenario_names`` lists, in its order (runs nothing).

    Each: ``scenario``, ``backend`` (engine, or "all" for the in-process rows), ``fixes``
    (the fix ids it proves), ``runs`` and ``why`` (the reason it is "n/a" here, else
    None). ``runs`` comes from what the row functions decide before running anything:
    the release's fix statuses, the transfer options, the source checkout; a run can
    still find the engine or the MoRI stand-in unusable and report the row then.
    """
    from sglang_disagg_ext.selftest.scenarios import f5, metadata_gate

    options = (options or TransferOptions()).validated()
    policy = releases.current_policy()
    out: List[Dict] = []

    def add(name: str, fix: str, backend: str, why: Optional[str] = None) -> None:
        out.append({"scenario": name, "backend": backend, "fixes": fix.split("/"), "runs": why is None, "why": why})

    if "mooncake" in backends:
        hooks = prefill_fault_hooks()
        for b in mooncake_scenarios(policy):
            add(b.name, b.fix, "mooncake", mooncake_hook_not_run_reason(b, hooks))
    if "nixl" in backends:
        from sglang_disagg_ext.selftest.scenarios import nixl_newest

        hooks = prefill_fault_hooks()
        routes = policy.routes("nixl")
        for b in nixl_newest.nixl_scenarios(policy):
            why = (f"{nixl_newest.PASSTHROUGH_ROW} ({nixl_newest.passthrough_reason(policy)})" if not routes
                   else nixl_newest.hook_not_run_reason(b, hooks))
            add(b.name, b.fix, "nixl", why)
    if "mori" in backends:
        from sglang_disagg_ext.selftest.scenarios import mori, mori_newest

        real = os.environ.get(mori.ENGINE_ENV, "").lower() == "real"
        for name, why in mori.not_run_reasons(policy, real, options).items():
            add(name, mori.FIX, mori.BACKEND, why)
        static = mori_newest.static_not_run_reason(policy, real, options)
        by_release = {} if static else mori_newest.release_not_run_reasons(policy)
        for name in mori_newest.ROW_NAMES:
            add(name, mori_newest.FIX, mori.BACKEND, static or by_release.get(name))
    # F5: where it is upstream the row still runs -ext (the release's own code); stock is n/a.
    for name in f5.f5_row_names():
        add(name, "F5", "all")
    why = metadata_gate.not_run_reason(policy)
    for name in metadata_gate.metadata_gate_row_names():
        add(name, "F10", "all", why)
    return out


def device_preflight(options: TransferOptions, backends: List[str], asked: Optional[str] = None) -> Optional[str]:
    """Why ``options.device`` cannot be used here, or None. Runs before any transfer.

    ``asked``: the device as the operator wrote it (for the message).
    """
    if options.device_type != "cuda":
        return None
    import torch

    return cuda_problem(
        asked or options.device,
        cuda_available=torch.cuda.is_available(),
        device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        mooncake_builds=installed_mooncake_builds() if "mooncake" in backends else [],
    )


def cuda_problem(device: str, *, cuda_available: bool, device_count: int, torch_version: str,
                 torch_cuda: Optional[str], mooncake_builds: List[str]) -> Optional[str]:
    """Pure: the reason a ``cuda[:N]`` device cannot be used, from the facts given."""
    if not cuda_available:
        return (
            f"--device {device}: CUDA is not available here (torch.cuda.is_available() is False; "
            f"torch {torch_version}, built for CUDA {torch_cuda}); "
            "GPU pools need a node with a GPU and a CUDA build of torch"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= device_count:
        return f"--device {device}: GPU index {index} does not exist here ({device_count} GPU(s) visible)"
    if mooncake_builds == [NON_CUDA_MOONCAKE]:
        return (
            f"--device {device}: the installed Mooncake is its non-CUDA build ({NON_CUDA_MOONCAKE}), "
            "built without GPU memory support; install mooncake-transfer-engine (the CUDA build) "
            "or limit the run with --backend nixl"
        )
    return None


NON_CUDA_MOONCAKE = "mooncake-transfer-engine-non-cuda"


def installed_mooncake_builds() -> List[str]:
    """Names of the installed Mooncake transfer-engine distributions."""
    from importlib import metadata

    found = []
    for name in ("mooncake-transfer-engine", NON_CUDA_MOONCAKE):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def default_backends() -> List[str]:
    # mori's engine is ROCm-only; its rows run against an in-repo stand-in
    # engine and are included whenever that module reports it can run.
    out = [b for b in ("mooncake", "nixl") if engine_importable(b)]
    out.append("mori")
    return out


def soak_main(args, policy, options) -> int:
    """``selftest --soak``: the soak through stock and -ext (Mooncake; NIXL one or more ranks a side), side by side; exit 0
    when the -ext run kept every invariant (``selftest.soak.judge``)."""
    from sglang_disagg_ext.selftest import soak

    if options.protocol != "tcp" or options.device_type != "cpu":
        print("selftest: --soak runs over TCP with CPU pools only", file=sys.stderr)
        return 2
    families = set(args.backend or ["mooncake"])
    if len(families) != 1 or not families <= {"mooncake", "nixl"}:
        print("selftest: --soak runs one backend: --backend mooncake (default) or --backend nixl", file=sys.stderr)
        return 2
    family = families.pop()
    fault_rate = args.fault_rate
    tp = (getattr(args, "prefill_tp", 1), getattr(args, "decode_tp", 1))
    if family == "nixl" and fault_rate > 0:
        print(f"[selftest] soak: NIXL: prefill's agent fails 1 in {max(2, round(1 / fault_rate))} transfers it "
              f"posts (NIXL handles name no request)", file=sys.stderr)
    state = True
    if tp != (1, 1):
        if family != "nixl":
            print("selftest: --soak with several ranks a side runs NIXL only (--backend nixl)", file=sys.stderr)
            return 2
        print("[selftest] soak: several ranks a side: no decode restart (one decode process only)", file=sys.stderr)
        if not soak.carries_state(family, *tp):
            print(f"[selftest] soak: SGLang {policy.version}'s {family}-ext does not send SWA state across TP "
                  f"sizes {tp[0]} -> {tp[1]}; KV and aux only", file=sys.stderr)
            state = False
    duplicate_rate = getattr(args, "duplicate_rate", 0.0)
    if duplicate_rate > 0 and tp != (1, 1):
        print("[selftest] soak: several ranks a side: no duplicate rooms", file=sys.stderr)
        duplicate_rate = 0.0
    orphan_rate = getattr(args, "orphan_rate", 0.0)
    orphan_fix = soak.ORPHAN_FIX[family]
    if orphan_rate > 0 and (tp != (1, 1) or not policy.is_live(orphan_fix)):
        print(f"[selftest] soak: no orphan rooms ({orphan_fix}: one rank a side, covered on SGLang "
              f"{policy.version}: {policy.is_live(orphan_fix)})", file=sys.stderr)
        orphan_rate = 0.0
    mismatched_rate = getattr(args, "mismatched_rate", 0.0)
    if mismatched_rate > 0 and (family != "mooncake" or tp != (1, 1)):
        print("[selftest] soak: no mismatched peer (Mooncake, one rank a side)", file=sys.stderr)
        mismatched_rate = 0.0
    cfg = soak.SoakConfig(requests=args.requests, wave=args.wave, fault_rate=fault_rate,
                          bad_rate=args.bad_rate, duplicate_rate=duplicate_rate, orphan_rate=orphan_rate,
                          mismatched_rate=mismatched_rate,
                          seed=args.seed,
                          restart_decode=not getattr(args, "no_restart", False) and tp == (1, 1),
                          prefill_tp=tp[0], decode_tp=tp[1], state=state)
    try:
        soak.make_scenario(cfg, engine=family).validate()
    except ValueError as exc:
        print(f"selftest: --soak: {exc}", file=sys.stderr)
        return 2
    backends = [f"{family}-ext"] if getattr(args, "ext_only", False) else [family, f"{family}-ext"]
    print(f"[selftest] soak on SGLang {policy.version}: {cfg.requests} requests, {cfg.wave} at a time, "
          f"fault rate {cfg.fault_rate:g}, bad-index rate {cfg.bad_rate:g}, duplicate-room rate "
          f"{cfg.duplicate_rate:g}, orphan-room rate {cfg.orphan_rate:g}, mismatched-peer rate "
          f"{cfg.mismatched_rate:g}, seed {cfg.seed}, decode restarted "
          f"{'in wave %d' % cfg.restart_wave() if cfg.restart_wave() is not None else 'never'}, "
          f"prefill TP {cfg.prefill_tp} -> decode TP {cfg.decode_tp}, "
          f"{'SWA state, ' if cfg.state else ''}KV and aux", file=sys.stderr)
    summaries = []
    for backend in backends:
        summaries.append(soak.run_soak(backend, cfg))
        print(f"[selftest] soak {backend}: {'PASS' if summaries[-1]['passed'] else 'FAIL'} "
              f"({summaries[-1]['wall_s']:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps({"sglang": policy.version, "config": dataclasses.asdict(cfg), "summaries": summaries},
                         indent=1))
    else:
        print(soak.format_summaries(summaries))
    return 0 if summaries[-1]["passed"] else 1


def main(args) -> int:
    policy = releases.current_policy()
    if policy.version is None:
        print(f"selftest: SGLang is not installed in {sys.executable}: install SGLang first (the self-test runs "
              "its managers), then this plugin, in the same environment", file=sys.stderr)
        return 2
    try:
        policy.check_supported()
    except releases.UnsupportedSGLangRelease as exc:
        print(f"selftest: {exc}", file=sys.stderr)
        return 2
    try:
        options = TransferOptions(args.protocol, args.device, getattr(args, "ib_device", None)).validated()
    except TransportOptionError as exc:
        print(f"selftest: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "soak", False):
        return soak_main(args, policy, options)
    # Once each, in the order given: "mooncake" and "mooncake-ext" name the same engine (cli).
    backends = list(dict.fromkeys(args.backend or default_backends()))
    if getattr(args, "list", False):
        if args.json:
            print(json.dumps(list_rows(backends, options), indent=2))
        else:
            for name in scenario_names(backends):
                print(name)
        return 0
    problem = device_preflight(options, backends, asked=args.device)
    if problem:
        print(f"selftest: {problem}", file=sys.stderr)
        return 2
    names = getattr(args, "scenario", None) or None
    if names:
        known = scenario_names(backends)
        unknown = [n for n in names if n not in known]
        if unknown:
            print(
                f"selftest: --scenario {', '.join(map(repr, unknown))}: no such scenario for backends "
                f"{', '.join(backends)}; known: {', '.join(map(repr, known))}",
                file=sys.stderr,
            )
            return 2
    verify = bool(getattr(args, "verify", False))
    if verify:
        # The workers inherit the environment; stock managers ignore the switch.
        os.environ[verification.VERIFY_ENV] = "1"
        for ext, why in verification.available(policy).items():
            if why and ext.split("-")[0] in backends:
                print(f"[selftest] --verify: {ext} rows run unverified: {why}", file=sys.stderr)
    print(f"[selftest] SGLang {policy.version} ({policy.support_text}); backends {', '.join(backends)}; "
          f"{options.describe()}; "
          + ("each row runs -ext only (--ext-only)" if getattr(args, "ext_only", False) else
             "each row runs stock and -ext (about 1-25 s a row, 2.5 min for all on a 2-core CPU machine)"),
          file=sys.stderr, flush=True)
    # SGLang's import-time UserWarnings (no Triton, no CUDA kernels) say nothing about transfers.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
    ext_only = bool(getattr(args, "ext_only", False))
    with progress_on_stderr():
        rows = collect_rows(backends, args.timeout, options=options, names=names, ext_only=ext_only)
    failed = [r for r in rows if r["ext"] not in ("pass", "n/a")]
    counts = totals(rows)
    if args.json:
        print(json.dumps({
            "sglang": policy.version,
            "plugin": __version__,
            "support": policy.support.value,
            "state_layout": policy.layout.value if policy.layout else None,
            "backends": backends,
            "transfer": options.describe(),
            "ext_only": ext_only,
            "verify": verify,
            "rows": rows,
            "totals": counts,
        }, indent=2))
    else:
        print(f"SGLang {policy.version} ({policy.support.value}, {policy.layout.value} state layout)")
        print(f"transfers: {options.describe()}" + ("; -ext sides verified (--verify)" if verify else ""))
        print(format_table(rows))
        for r in failed:
            print(f"\nFAILED with -ext: {r['scenario']}\n{r.get('ext_detail') or ''}")
        # A note shared by several rows is printed once, with the rows it covers.
        for label, key, keep in (("note", "engine", lambda r: r.get("engine")),
                                 ("not run", "not_run", lambda r: r["ext"] == "n/a")):
            grouped: Dict[str, List[str]] = {}
            for r in rows:
                if keep(r):
                    grouped.setdefault(str(r[key]), []).append(r["scenario"])
            for text, names in grouped.items():
                print(f"{label} [{names[0]}" + (f" and {len(names) - 1} more row(s)" if len(names) > 1 else "")
                      + f"]: {text}")
        if verify:
            checked: Dict[str, int] = {}
            for r in rows:
                for k, v in (r.get("digests") or {}).items():
                    checked[k] = checked.get(k, 0) + v
            print("\nverified transfers (--verify): rooms decode checked against prefill's digest: "
                  + (", ".join(f"{v} {k}" for k, v in sorted(checked.items())) or "none"))
        print(f"\n{summary_line(counts)}")
    ran = sum(1 for r in rows if r["ext"] != "n/a")
    min_rows = max(1, int(getattr(args, "min_rows", 1) or 1))
    if ran < min_rows:
        print(f"selftest: {ran} -ext row(s) ran here, fewer than {min_rows}: this node is not checked "
              "(every row is n/a; the reasons are above)", file=sys.stderr)
        return 1
    return 1 if failed else 0
