"""Fork server: import torch and SGLang once, then fork one process per harness worker.

    python -m sglang_disagg_ext.selftest.harness.forkserver

Reads JSON lines on stdin, ``{"module", "args", "env", "log", "cwd"}``, and
answers each with ``{"pid": N}`` on stdout after forking a child that leads
its own session, has ``env`` as its whole environment, writes stdout/stderr to
``log`` and runs ``python -m module args``. When a child ends, its exit code is
written to ``<log>.rc``. The server ends when stdin closes (its parent is gone
or done); its children then see their parent gone and leave (the worker's
watchdog).

Why forking is sound here: the server only imports (no engine, no thread pool,
no CUDA context, no socket exists before the fork; it stays single-threaded in
Python and checks it), and SGLang reads its environment when a manager is
built (``envs.X.get()``, ``get_int_env_var`` in ``__init__``), not at import,
so each child's ``env`` takes effect as it would in a fresh interpreter. The
plugin is loaded, and SGLang patched, in the child only.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import sys
import threading
import time
import warnings

# What every harness worker imports before its first transfer; optional
# engines (NIXL, MoRI) may be missing on a node and are then imported by no one.
WARM_MODULES = (
    "torch",
    "numpy",
    "sglang.srt.server_args",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.mori.conn",
    "sglang_disagg_ext.selftest.harness.sglang_setup",
    "sglang_disagg_ext.selftest.harness.patterns",
)


def _warm() -> dict:
    imported, missing = [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in WARM_MODULES:
            try:
                importlib.import_module(name)
                imported.append(name)
            except Exception as exc:  # an engine this node lacks
                missing[name] = f"{type(exc).__name__}: {exc}"[:200]
    return {"imported": imported, "missing": missing}


def _reply(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _run_child(req: dict) -> None:
    """In the forked child: become the worker process. Never returns."""
    try:
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [req["module"], *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reap(children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log = children.pop(pid, None)
        if log is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        tmp = log + ".rc.tmp"
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, log + ".rc")


def main() -> None:
    t0 = time.monotonic()
    report = _warm()
    threads = threading.active_count()
    report.update(ready=threads == 1, seconds=round(time.monotonic() - t0, 2), python_threads=threads)
    if threads != 1:
        report["why"] = f"{threads} Python threads after imports: forking would copy a half-held lock"
    _reply(report)
    if threads != 1:
        return
    children: dict = {}
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        _reap(children)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # parent done or gone
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(req)
            children[pid] = req["log"]
            _reply({"pid": pid})
    _reap(children)


if __name__ == "__main__":
    main()
