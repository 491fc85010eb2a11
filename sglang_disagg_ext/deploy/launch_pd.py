"""Start a 1P1D deployment (prefill server, decode server, router) with one command, or stop it.

    sglang-disagg-ext launch-pd start --model-path /models/Llama-3.1-8B-Instruct [options]
    sglang-disagg-ext launch-pd start --model-path meta-llama/Llama-3.1-8B-Instruct  # a Hub id
    sglang-disagg-ext launch-pd start --model-path ... --dry-run     # print the 3 commands
    sglang-disagg-ext launch-pd stop --run-dir runs/pd-20260101-120000-1234

``start`` checks everything it can before starting anything (model folder, or
a Hugging Face Hub id passed to SGLang unchanged; NVIDIA or AMD GPUs; ports; the
installed SGLang release; the router), then starts prefill and decode, waits
until both answer ``/health``, starts the router and waits for it.
If a server exits or the wait runs past ``--timeout``, it says which server and
where its log is, and stops every process it started. PIDs and logs go to the
run folder; ``stop`` ends exactly those PIDs (and their descendants).

The server module follows the installed release (``releases.ReleasePolicy.server_module``):
``sglang.launch_server`` where SGLang loads the plugin itself, the plugin's
``sglang_disagg_ext.launch_server`` on 0.5.10.post1. ``--prefill-python`` / ``--decode-python``
run a server from another environment (another SGLang release: a rolling upgrade rehearsed on
one host); its module and flags follow that environment's release, read by running it. The router is
``sglang_router.launch_router --pd-disaggregation`` when installed, else the
in-tree ``sglang_disagg_ext.deploy.mini_lb`` (no SGLang release in range ships one).

Exit codes: 0 ready (or dry run printed), 2 bad options or a failed check
(nothing started), 1 a started server failed (everything started was stopped).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from sglang_disagg_ext.deploy import DeployError
from sglang_disagg_ext.deploy import commands as cmds

DEFAULT_HEALTH_TIMEOUT = 900.0


class Interrupted(Exception):
    pass


def _err(msg: str) -> None:
    print(f"launch_pd: {msg}", file=sys.stderr, flush=True)


def default_run_dir() -> Path:
    return Path("runs") / f"pd-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def build_parser() -> argparse.ArgumentParser:
    from sglang_disagg_ext.help_text import plain_text  # --help shows the docstring without its RST markup

    parser = argparse.ArgumentParser(
        prog="launch_pd", description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="start prefill, decode and router; wait until all answer /health")
    p.add_argument("--model-path", required=True,
                   help="local model folder (holds config.json), or a Hugging Face Hub id (org/name) "
                        "that SGLang fetches from the Hub")
    p.add_argument("--backend", default="mooncake-ext", choices=cmds.KNOWN_BACKENDS,
                   help="transfer backend (default mooncake-ext)")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill tensor-parallel size (default 1)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode tensor-parallel size (default 1)")
    p.add_argument("--prefill-base-gpu-id", type=int, default=0, help="first GPU of prefill (default 0)")
    p.add_argument("--decode-base-gpu-id", type=int, default=None,
                   help="first GPU of decode (default: the first GPU after prefill's)")
    p.add_argument("--host", default="127.0.0.1", help="address all three bind to (default 127.0.0.1)")
    p.add_argument("--prefill-port", type=int, help="prefill HTTP port (default: a free port)")
    p.add_argument("--decode-port", type=int, help="decode HTTP port (default: a free port)")
    p.add_argument("--bootstrap-port", type=int, help="prefill bootstrap port (default: a free port)")
    p.add_argument("--router-port", type=int, help="router port (default: a free port)")
    p.add_argument("--router-metrics-port", type=int,
                   help="sglang_router's Prometheus port (default: a free port; its own default, 29000, "
                        "allows one router per host)")
    p.add_argument("--ib-device", help="RDMA device(s) for the transfer engine, e.g. mlx5_0")
    p.add_argument("--protocol", default="rdma", choices=cmds.PROTOCOLS,
                   help="Mooncake transport (default rdma; tcp sets MC_FORCE_TCP/MOONCAKE_PROTOCOL)")
    p.add_argument("--router", default="auto", choices=("auto",) + cmds.ROUTERS,
                   help="auto: sglang_router when installed, else the in-tree mini load balancer")
    p.add_argument("--trust-remote-code", action="store_true", help="pass --trust-remote-code to both servers")
    p.add_argument("--server-args", default="", help="extra arguments for both servers (one shell-quoted string)")
    p.add_argument("--prefill-args", default="", help="extra arguments for prefill only")
    p.add_argument("--decode-args", default="", help="extra arguments for decode only")
    p.add_argument("--server-module", default=None,
                   help="module run as `python -m MODULE` for both servers (default: per SGLang release)")
    p.add_argument("--prefill-python", default=None,
                   help="Python interpreter of the environment prefill runs from (default: this one); "
                        "with --decode-python, two SGLang releases side by side, as in a rolling upgrade. "
                        "The plugin must be installed there too: its release is read through it")
    p.add_argument("--decode-python", default=None,
                   help="Python interpreter of the environment decode runs from (default: this one)")
    p.add_argument("--run-dir", type=Path, default=None, help="folder for run.json and logs (default runs/pd-...)")
    p.add_argument("--timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT,
                   help=f"seconds to wait for /health on all three (default {DEFAULT_HEALTH_TIMEOUT:g})")
    p.add_argument("--skip-gpu-check", action="store_true",
                   help="start even if fewer GPUs are visible (nvidia-smi, amd-smi or rocm-smi) "
                        "than the servers need")
    p.add_argument("--device", default="cuda", choices=cmds.DEVICES,
                   help="cuda (default), or cpu: both servers on this machine's CPU with SGLang's CPU switches "
                        "(a tiny model; for trying PD before a GPU cluster; TP 1, no GPU check)")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check that starts no process (model folder, SGLang, router, GPUs, ports), "
                        "then print the three commands and start nothing")

    p = sub.add_parser("restart", help="stop one server of a run folder (if it runs) and start it again "
                                       "with its recorded command; wait for /health")
    p.add_argument("--run-dir", type=Path, required=True, help="run folder written by start")
    p.add_argument("--server", required=True, choices=("prefill", "decode", "router"), help="which server")
    p.add_argument("--timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT,
                   help=f"seconds to wait for /health (default {DEFAULT_HEALTH_TIMEOUT:g})")
    p.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL (default 15)")

    p = sub.add_parser("stop", help="stop the processes recorded in a run folder")
    p.add_argument("--run-dir", type=Path, required=True, help="run folder written by start")
    p.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL (default 15)")
    return parser


def _split(what: str, text: str) -> List[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise DeployError(f"{what} is not a valid shell-quoted string: {exc}") from None


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` is a Hugging Face Hub repo id with its namespace ("org/name"), as
    huggingface_hub itself validates one (SGLang depends on it). A leading '/', '.' or '~'
    never passes, so every path-looking argument stays a path."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # no huggingface_hub: SGLang could not fetch it either
        return False
    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_model_arg(text: str) -> Tuple[str, bool]:
    """(the --model-path to pass on, whether it is a Hub id).

    An existing path is a local model (made absolute: the servers may not share our working
    folder). A string that is no existing path but has the form of a Hub id goes to SGLang
    unchanged, which downloads it (or takes it from the Hub cache), as ``sglang.launch_server``
    does itself. Anything else is a path, and a missing one is refused by the preflight.
    """
    if not text:
        return "", False
    path = Path(text).expanduser()
    if not path.exists() and looks_like_hub_id(text):
        return text, True
    return str(path.absolute()), False


def hub_note(model: str) -> str:
    return (f"model {model} is not a local path: passed unchanged to SGLang, which fetches it from "
            "the Hugging Face Hub (or its local Hub cache) when the servers start")


def options_from_args(args, ports: List[int]) -> cmds.PDOptions:
    both = _split("--server-args", args.server_args)
    return cmds.PDOptions(
        model_path=resolve_model_arg(args.model_path)[0],
        prefill_port=ports[0],
        decode_port=ports[1],
        bootstrap_port=ports[2],
        router_port=ports[3],
        router_metrics_port=ports[4],
        backend=args.backend,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_base_gpu_id=args.prefill_base_gpu_id,
        decode_base_gpu_id=args.decode_base_gpu_id,
        host=args.host,
        ib_device=args.ib_device,
        protocol=args.protocol,
        trust_remote_code=args.trust_remote_code,
        prefill_extra_args=tuple(both + _split("--prefill-args", args.prefill_args)),
        decode_extra_args=tuple(both + _split("--decode-args", args.decode_args)),
        router=cmds.choose_router(args.router, router_installed()),
        device=args.device,
    )


def router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def resolve_ports(args) -> List[int]:
    from sglang_disagg_ext.deploy.procs import free_ports

    given = [args.prefill_port, args.decode_port, args.bootstrap_port, args.router_port, args.router_metrics_port]
    fresh = iter(free_ports(args.host, sum(1 for p in given if p is None)))
    return [p if p is not None else next(fresh) for p in given]


def check_model_path(model_path: str) -> None:
    path = Path(model_path)
    if not path.exists():
        raise DeployError(f"model path {model_path} does not exist (give a local model folder)")
    if not path.is_dir():
        raise DeployError(f"model path {model_path} is not a folder")
    if not (path / "config.json").is_file():
        raise DeployError(f"model path {model_path} has no config.json: not a model folder")


def preflight(opts: cmds.PDOptions, specs: List[cmds.ServerSpec], skip_gpu_check: bool) -> List[str]:
    """Everything that can be checked before a process starts. Raises DeployError; returns
    notes for the operator (what was not checked here and why)."""
    from sglang_disagg_ext.deploy.procs import gpu_count, port_in_use

    notes = []
    # options_from_args made every local path absolute, so only a Hub id it passed through
    # has this form; whether the Hub has it is SGLang's to find out at start.
    if looks_like_hub_id(opts.model_path):
        notes.append(hub_note(opts.model_path))
    else:
        check_model_path(opts.model_path)
    if importlib.util.find_spec("sglang") is None:
        raise DeployError(f"SGLang is not installed in {sys.executable}")
    if opts.router == "sglang-router" and not router_installed():
        raise DeployError("--router sglang-router: sglang_router is not installed (pip install sglang-router, "
                          "or use --router mini-lb)")
    if not skip_gpu_check and opts.device != "cpu":
        needed = opts.gpus_needed()
        have, how = gpu_count()
        if have < needed:
            raise DeployError(
                f"the servers need {needed} GPU(s) (GPU ids 0..{needed - 1}) but {have} "
                f"{'is' if have == 1 else 'are'} visible ({how}); --skip-gpu-check starts them anyway"
            )
    what = {"prefill": "--prefill-port", "decode": "--decode-port", "router": "--router-port"}
    checks = [(what[s.name], s.port) for s in specs] + [("--bootstrap-port", opts.bootstrap_port)]
    if opts.router == "sglang-router" and opts.router_metrics_port is not None:
        checks.append(("--router-metrics-port", opts.router_metrics_port))
    for flag, port in checks:
        reason = port_in_use(opts.host, port)
        if reason:
            raise DeployError(f"port {port} ({flag}) on {opts.host} is not available: {reason}")
    return notes


def runtime_facts(backend: str, device: str) -> dict:
    """This environment's ``ServerRuntime`` fields for ``backend`` (``server_runtime`` runs this
    in another interpreter); ``{"error": ...}`` where it cannot serve that backend."""
    from sglang_disagg_ext import releases

    policy = releases.current_policy()
    try:
        module = cmds.resolve_server_module(policy, backend)
    except DeployError as exc:
        return {"error": str(exc)}
    backup = device == "cpu" and policy.version is not None and releases.features().server_args_decode_retraction_backup
    return {"python": sys.executable, "server_module": module, "sglang_version": policy.version,
            "decode_backup_flag": bool(backup)}


_RUNTIME_PROBE = ("import json, sys; from sglang_disagg_ext.deploy.launch_pd import runtime_facts; "
                  "print(json.dumps(runtime_facts(sys.argv[1], sys.argv[2])))")


def server_runtime(flag: str, python: Optional[str], backend: str, device: str) -> cmds.ServerRuntime:
    """The runtime of a server started from ``python`` (None: this interpreter). Another
    interpreter is asked by running it: its release decides its server module and flags."""
    import json
    import subprocess

    if python is None:
        facts = runtime_facts(backend, device)
    else:
        try:
            done = subprocess.run([python, "-c", _RUNTIME_PROBE, backend, device], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DeployError(f"{flag} {python}: cannot run it: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DeployError(f"{flag} {python}: cannot read its SGLang release and plugin ({last}); "
                              "install SGLang and sglang-disagg-ext in that environment")
        facts = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in facts:
        raise DeployError(facts["error"] if python is None else f"{flag} {python}: {facts['error']}")
    if facts["sglang_version"] is None:
        raise DeployError(f"SGLang is not installed in {python or facts['python']}"
                          + (f" ({flag})" if python is not None else ""))
    # The command names the interpreter as the operator gave it (a venv's bin/python, a wrapper).
    return cmds.ServerRuntime(**dict(facts, python=python or facts["python"]))


def _raise_interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def start(args) -> int:
    from sglang_disagg_ext import releases
    from sglang_disagg_ext.deploy.procs import Launcher

    try:
        opts = options_from_args(args, resolve_ports(args))
        for warning in cmds.validate_pd_options(opts):
            _err(f"warning: {warning}")
        policy = releases.current_policy()
        runtimes = {role: server_runtime(f"--{role}-python", python, opts.backend, opts.device)
                    for role, python in (("prefill", args.prefill_python), ("decode", args.decode_python))}
        if args.server_module:
            runtimes = {role: dataclasses.replace(rt, server_module=args.server_module) for role, rt in runtimes.items()}
        specs = cmds.build_pd_servers(opts, runtimes["prefill"], runtimes["decode"], router_python=sys.executable)
    except DeployError as exc:
        _err(str(exc))
        return 2

    # A dry run is the deployment gate: every check that starts no process, then the commands.
    try:
        for note in preflight(opts, specs, args.skip_gpu_check):
            _err(note)
    except DeployError as exc:
        _err(f"{exc}\nnothing was started")
        return 2

    if args.dry_run:
        for spec in specs:
            print(spec.shell_line())
        return 0

    run_dir = args.run_dir or default_run_dir()
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        if any(run_dir.iterdir()):
            _err(f"run folder {run_dir} already exists and is not empty; nothing was started")
            return 2
    except OSError as exc:
        _err(f"cannot create run folder {run_dir}: {exc}; nothing was started")
        return 2

    launcher = Launcher(run_dir)
    launcher.record.data.update(
        {
            "sglang_version": policy.version,
            "server_sglang_versions": {role: rt.sglang_version for role, rt in runtimes.items()},
            "backend": opts.backend,
            "router": opts.router,
            "server_module": runtimes["prefill"].server_module,
            "router_url": specs[2].url,
        }
    )
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        prefill, decode, router = specs
        launcher.start(prefill)
        launcher.start(decode)
        _err(f"started prefill (pid {launcher.procs['prefill'].pid}) and decode "
             f"(pid {launcher.procs['decode'].pid}); waiting up to {args.timeout:g} s for /health")
        deadline = time.monotonic() + args.timeout
        launcher.wait_healthy(["prefill", "decode"], timeout=args.timeout, progress=_err)
        launcher.start(router)
        launcher.wait_healthy(["router"], timeout=max(1.0, deadline - time.monotonic()), progress=_err)
        launcher.wait_router_workers("router", [prefill.url, decode.url],
                                     timeout=max(1.0, deadline - time.monotonic()), progress=_err)
    except (DeployError, Interrupted, KeyboardInterrupt, OSError) as exc:
        reason = f"interrupted ({exc})" if isinstance(exc, (Interrupted, KeyboardInterrupt)) else str(exc)
        _err(reason)
        _err("stopping every process this run started")
        for line in launcher.stop_all(grace=10.0):
            _err(f"  {line}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)

    versions = {rt.sglang_version for rt in runtimes.values()}
    release = (f"SGLang {versions.pop()}" if len(versions) == 1 else
               f"prefill on SGLang {runtimes['prefill'].sglang_version}, decode on {runtimes['decode'].sglang_version}")
    print(f"PD deployment ready: {release}, backend {opts.backend}, router {opts.router}")
    for entry in launcher.record.servers:
        print(f"  {entry['name']:<8} pid {entry['pid']:<8} {entry['url']:<28} log {entry['log']}")
    print(f"router URL: {specs[2].url}")
    print(f"run folder: {run_dir}")
    print(f"stop with:  sglang-disagg-ext launch-pd stop --run-dir {shlex.quote(str(run_dir))}")
    return 0


def restart(args) -> int:
    """Stop the newest recorded ``--server`` of a run (if it still runs), start it again with the
    same command, environment and log, and wait until it answers ``/health``."""
    from sglang_disagg_ext.deploy.procs import Launcher, RunRecord, stop_recorded

    try:
        record = RunRecord.load(args.run_dir)
    except DeployError as exc:
        _err(str(exc))
        return 2
    entries = [e for e in record.servers if e["name"] == args.server]
    if not entries:
        _err(f"{args.run_dir}: no {args.server} server recorded")
        return 2
    entry = entries[-1]
    for line in stop_recorded([entry], grace=args.grace):
        _err(line)
    spec = cmds.ServerSpec(entry["name"], list(entry["argv"]), entry["url"], int(entry["url"].rsplit(":", 1)[1]),
                           dict(entry.get("env") or {}))
    launcher = Launcher(args.run_dir, record)
    try:
        launcher.start(spec)
        launcher.wait_healthy([spec.name], timeout=args.timeout, progress=_err)
    except (DeployError, OSError) as exc:
        _err(str(exc))
        for line in stop_recorded([record.servers[-1]], grace=10.0):
            _err(f"  {line}")
        return 1
    print(f"{spec.name} restarted: pid {launcher.procs[spec.name].pid}, {spec.url}")
    return 0


def stop(args) -> int:
    from sglang_disagg_ext.deploy.procs import RunRecord, stop_recorded

    try:
        record = RunRecord.load(args.run_dir)
    except DeployError as exc:
        _err(str(exc))
        return 2
    for line in stop_recorded(record.servers, grace=args.grace):
        print(line)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return {"start": start, "restart": restart, "stop": stop}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
