"""Run SGLang's own GSM8K evaluation against a PD router (and optionally a colocated server).

    sglang-disagg-ext gsm8k --run-dir runs/pd-... --data-path /data/gsm8k/test.jsonl
    sglang-disagg-ext gsm8k --url http://127.0.0.1:8000 --data-path test.jsonl \\
        --colocated-model-path /models/Llama-3.1-8B-Instruct --colocated-base-gpu-id 2

The evaluation is SGLang's own: the installed release's
``sglang.test.few_shot_gsm8k.run_eval`` (read in the 0.5.10.post1, 0.5.11,
0.5.12.post1, 0.5.16 and 0.5.23 wheels), called in a child process (SGLang's import and its global backend stay out of
this one, and a timeout can stop it) that writes the metrics dict ``run_eval`` returns
as JSON: accuracy, invalid rate, latency, output throughput. Nothing is parsed from
printed text.
With ``--colocated-url`` (a running server) or ``--colocated-model-path`` (this
script starts one, waits for ``/health`` and stops it by PID afterwards) the
same evaluation runs against a non-PD server and the difference is printed.

Nothing is downloaded unless ``--allow-download`` is given: ``--data-path``
names a local GSM8K ``test.jsonl`` (one ``{"question": ..., "answer": ...}`` per
line, answers ending ``#### <number>``). Exit codes: 0 done, 2 bad options or
no server reachable (nothing run), 1 the evaluation failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

from sglang_disagg_ext.deploy import DeployError

FEW_SHOT_MODULE = "sglang.test.few_shot_gsm8k"

# The child: SGLang's evaluation function with the options its command line would give
# (argv[1], JSON), its returned metrics written to argv[2]. The 0.5.10.post1, 0.5.11, 0.5.12.post1,
# 0.5.16 and 0.5.23 wheels read exactly these fields in ``run_eval(args)`` (host, port, data_path, num_questions,
# num_shots, parallel, max_new_tokens, temperature) and returns accuracy, invalid, latency
# and output_throughput.
_CHILD = """\
import argparse, json, sys
from sglang.test.few_shot_gsm8k import run_eval
metrics = run_eval(argparse.Namespace(**json.loads(sys.argv[1])))
with open(sys.argv[2], "w") as out:
    json.dump({key: float(value) for key, value in dict(metrics).items()}, out)
"""
# run_eval's key -> ours (None where a release does not return it).
_METRICS = {"accuracy": "accuracy", "invalid": "invalid", "latency": "latency_s",
            "output_throughput": "output_throughput"}


@dataclasses.dataclass
class EvalOptions:
    data_path: Optional[str]
    num_questions: int = 200
    num_shots: int = 5
    parallel: int = 128
    max_new_tokens: int = 512


# ---------------------------------------------------------------- pure parts

def check_data_file(path: str, num_shots: int) -> int:
    """Validate a local GSM8K JSONL file; return its number of questions."""
    p = Path(path)
    if not p.is_file():
        raise DeployError(f"--data-path {path}: no such file")
    count = 0
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DeployError(f"--data-path {path}:{lineno}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) \
                    or not isinstance(row.get("answer"), str):
                raise DeployError(f"--data-path {path}:{lineno}: needs string fields 'question' and 'answer'")
            if not re.search(r"\d", row["answer"]):
                raise DeployError(f"--data-path {path}:{lineno}: the answer holds no number")
            count += 1
    if count < max(1, num_shots):
        raise DeployError(f"--data-path {path}: {count} question(s), fewer than --num-shots {num_shots}")
    return count


def split_url(url: str):
    """(host argument, port) for few_shot_gsm8k's ``--host``/``--port``."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise DeployError(f"{url!r} is not an http(s) URL like http://127.0.0.1:8000")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    host = parsed.hostname
    if ":" in host:
        host = f"[{host}]"
    # few_shot_gsm8k takes a bare host for http; a scheme is still accepted (with a warning).
    return (host if parsed.scheme == "http" else f"https://{host}"), port


def eval_args(url: str, opts: EvalOptions) -> dict:
    """The ``args`` SGLang's ``few_shot_gsm8k.run_eval`` reads, as its own command line would set them."""
    host, port = split_url(url)
    return {"host": host, "port": port, "data_path": opts.data_path, "num_questions": opts.num_questions,
            "num_shots": opts.num_shots, "parallel": opts.parallel, "max_new_tokens": opts.max_new_tokens,
            "temperature": 0.0}


def eval_command(python: str, url: str, opts: EvalOptions, result_path: Path) -> List[str]:
    return [python, "-c", _CHILD, json.dumps(eval_args(url, opts)), str(result_path)]


def read_result(result_path: Path, output: str) -> Dict[str, Optional[float]]:
    """Our metrics from the JSON the child wrote; DeployError naming what is missing, with the
    child's last lines, when it wrote none or lacks accuracy or latency."""
    tail = "\n".join((output or "").splitlines()[-15:])
    try:
        got = json.loads(Path(result_path).read_text())
    except (OSError, ValueError) as exc:
        raise DeployError(f"{FEW_SHOT_MODULE}.run_eval returned no metrics ({exc}); its output ended:\n{tail}") from None
    out: Dict[str, Optional[float]] = {ours: got.get(theirs) for theirs, ours in _METRICS.items()}
    missing = [theirs for theirs, ours in _METRICS.items() if ours in ("accuracy", "latency_s") and out[ours] is None]
    if missing:
        raise DeployError(f"{FEW_SHOT_MODULE}.run_eval returned no {' / '.join(missing)}; "
                          f"it returned {sorted(got)}; its output ended:\n{tail}")
    return out


def compare(pd: dict, colocated: dict) -> Dict[str, Optional[float]]:
    """PD minus colocated, per metric (None where either side lacks it)."""
    return {k: (None if pd.get(k) is None or colocated.get(k) is None else pd[k] - colocated[k])
            for k in ("accuracy", "invalid", "latency_s", "output_throughput")}


def _fmt(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(results: Dict[str, dict], difference: Optional[dict] = None) -> str:
    lines = [f"{'target':<10} {'accuracy':>9} {'invalid':>8} {'latency_s':>10} {'output_tok/s':>13}"]
    for name, m in results.items():
        lines.append(f"{name:<10} {_fmt(m['accuracy'], 3):>9} {_fmt(m['invalid'], 3):>8} "
                     f"{_fmt(m['latency_s'], 3):>10} {_fmt(m['output_throughput'], 1):>13}")
    if difference is not None:
        lines.append(f"{'pd - colo':<10} {_fmt(difference['accuracy'], 3):>9} {_fmt(difference['invalid'], 3):>8} "
                     f"{_fmt(difference['latency_s'], 3):>10} {_fmt(difference['output_throughput'], 1):>13}")
    return "\n".join(lines)


# ---------------------------------------------------------------- processes and HTTP

def check_eval_module() -> str:
    """SGLang's evaluation module's name, or DeployError when this Python cannot import it."""
    try:
        if importlib.util.find_spec(FEW_SHOT_MODULE) is not None:
            return FEW_SHOT_MODULE
    except ModuleNotFoundError:
        pass  # sglang itself is missing
    raise DeployError(f"{FEW_SHOT_MODULE} is not importable in {sys.executable} (is SGLang installed? "
                      "0.5.10.post1-0.5.23 ship it)")


def probe(url: str, timeout: float) -> Optional[str]:
    """Why ``url`` cannot serve the evaluation (None when /get_model_info answers 200)."""
    target = url.rstrip("/") + "/get_model_info"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:
            if resp.status == 200:
                return None
            return f"GET {target} answered HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"GET {target} answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"GET {target} failed: {reason}"


def run_eval(url: str, opts: EvalOptions, workdir: Path, timeout: float, label: str) -> Dict[str, Optional[float]]:
    workdir.mkdir(parents=True, exist_ok=True)  # run_eval writes tmp_output_gsm8k.txt to its cwd
    result_path = workdir.absolute() / "metrics.json"
    result_path.unlink(missing_ok=True)
    argv = eval_command(sys.executable, url, opts, result_path)
    print(f"gsm8k: [{label}] {FEW_SHOT_MODULE}.run_eval({json.dumps(eval_args(url, opts))})",
          file=sys.stderr, flush=True)
    try:
        done = subprocess.run(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DeployError(f"[{label}] {FEW_SHOT_MODULE}.run_eval did not finish within {timeout:g} s (stopped)") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout or "").splitlines()[-15:])
        raise DeployError(f"[{label}] {FEW_SHOT_MODULE}.run_eval exited with code {done.returncode}; "
                          f"output ended:\n{tail}")
    return read_result(result_path, done.stdout)


def build_parser() -> argparse.ArgumentParser:
    from sglang_disagg_ext.help_text import plain_text  # --help shows the docstring without its RST markup

    p = argparse.ArgumentParser(prog="gsm8k", description=plain_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="router (or any SGLang server) URL, e.g. http://127.0.0.1:8000")
    target.add_argument("--run-dir", type=Path, help="run folder from launch_pd: use its router")
    p.add_argument("--data-path", help="local GSM8K test.jsonl")
    p.add_argument("--allow-download", action="store_true",
                   help="without --data-path, let SGLang download GSM8K from GitHub")
    p.add_argument("--num-questions", type=int, default=200,
                   help="questions evaluated, from the start of the file (default 200)")
    p.add_argument("--num-shots", type=int, default=5,
                   help="worked examples (the file's first questions, with answers) before each question (default 5)")
    p.add_argument("--parallel", type=int, default=128, help="requests in flight at once (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens generated per answer at most (default 512)")
    colo = p.add_mutually_exclusive_group()
    colo.add_argument("--colocated-url", help="also evaluate this running non-PD server")
    colo.add_argument("--colocated-model-path", help="start a non-PD server of this model, evaluate it, stop it")
    p.add_argument("--colocated-tp", type=int, default=1, help="tensor parallel size of the started server (default 1)")
    p.add_argument("--colocated-base-gpu-id", type=int, default=0, help="first GPU of the started server (default 0)")
    p.add_argument("--colocated-port", type=int, default=None, help="default: a free port")
    p.add_argument("--colocated-args", default="", help="extra server arguments (one shell-quoted string)")
    p.add_argument("--trust-remote-code", action="store_true", help="pass --trust-remote-code to the started server")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="seconds to wait for a started colocated server's /health")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per evaluation run")
    p.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds to wait for a server to answer before giving up")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _err(msg: str) -> None:
    print(f"gsm8k: {msg}", file=sys.stderr, flush=True)


def _start_colocated(args, run_dir: Path):
    import shlex

    from sglang_disagg_ext.deploy.commands import build_colocated_server
    from sglang_disagg_ext.deploy.launch_pd import check_model_path
    from sglang_disagg_ext.deploy.procs import Launcher, free_ports, port_in_use

    model = str(Path(args.colocated_model_path).expanduser().absolute())
    check_model_path(model)
    port = args.colocated_port or free_ports("127.0.0.1", 1)[0]
    reason = port_in_use("127.0.0.1", port)
    if reason:
        raise DeployError(f"port {port} (--colocated-port) is not available: {reason}")
    spec = build_colocated_server(model, port, sys.executable, tp=args.colocated_tp,
                                  base_gpu_id=args.colocated_base_gpu_id,
                                  trust_remote_code=args.trust_remote_code,
                                  extra_args=shlex.split(args.colocated_args))
    launcher = Launcher(run_dir)
    launcher.start(spec)
    _err(f"started colocated server (pid {launcher.procs['colocated'].pid}, log {launcher.log_path('colocated')})")
    return launcher, spec.url


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    opts = EvalOptions(args.data_path, args.num_questions, args.num_shots, args.parallel, args.max_new_tokens)
    try:
        for flag in ("num_questions", "num_shots", "parallel", "max_new_tokens"):
            if getattr(args, flag) < (0 if flag == "num_shots" else 1):
                raise DeployError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
        if args.data_path:
            count = check_data_file(args.data_path, args.num_shots)
            if count < args.num_questions:
                _err(f"{args.data_path} holds {count} questions; evaluating those")
            opts.data_path = str(Path(args.data_path).absolute())
        elif not args.allow_download:
            raise DeployError("give --data-path (a local GSM8K test.jsonl) or --allow-download")
        if args.run_dir:
            from sglang_disagg_ext.deploy.procs import RunRecord

            record = RunRecord.load(args.run_dir)
            url = record.data.get("router_url") or record.url_of("router")
            if not url:
                raise DeployError(f"{args.run_dir}/run.json records no router URL")
        else:
            url = args.url
        split_url(url)
        deadline = time.monotonic() + args.connect_timeout
        reason = probe(url, timeout=args.connect_timeout)
        if reason:
            raise DeployError(f"no SGLang server answers at {url} ({reason}); "
                              "start one first (sglang-disagg-ext launch-pd start ...)")
        if args.colocated_url:
            split_url(args.colocated_url)
            reason = probe(args.colocated_url, timeout=max(1.0, deadline - time.monotonic()))
            if reason:
                raise DeployError(f"no SGLang server answers at --colocated-url {args.colocated_url} ({reason})")
        # After the servers answer: finding the module imports SGLang (seconds of CPU), and
        # "no server" should be told at once.
        module = check_eval_module()
    except DeployError as exc:
        _err(str(exc))
        return 2

    run_dir = args.run_dir or Path("runs") / f"gsm8k-{time.strftime('%Y%m%d-%H%M%S')}"
    results: Dict[str, dict] = {}
    launcher = None
    try:
        results["pd"] = run_eval(url, opts, run_dir / "gsm8k-pd", args.timeout, "pd")
        colo_url = args.colocated_url
        if args.colocated_model_path:
            # its own run.json: run_dir may be a PD run folder whose record must stay intact
            launcher, colo_url = _start_colocated(args, run_dir / "colocated")
            launcher.wait_healthy(["colocated"], timeout=args.health_timeout, progress=_err)
        if colo_url:
            results["colocated"] = run_eval(colo_url, opts, run_dir / "gsm8k-colocated",
                                            args.timeout, "colocated")
    except DeployError as exc:
        _err(str(exc))
        return 1
    finally:
        if launcher is not None:
            for line in launcher.stop_all(grace=10.0):
                _err(line)

    difference = compare(results["pd"], results["colocated"]) if "colocated" in results else None
    if args.json:
        print(json.dumps({"module": module, "url": url, "results": results, "difference": difference}, indent=2))
    else:
        print(f"GSM8K via {module}: {opts.num_questions} questions, {opts.num_shots} shots")
        print(format_table(results, difference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
