"""Item 5: what loading the plugin adds to SGLang's plugin loading.

Each sample is a fresh interpreter that first imports what SGLang has imported
by the time it calls ``sglang.srt.plugins.load_plugins()`` (``server_args``
and the plugin framework: ``launch_server`` imports them at module level), then
times ``load_plugins()`` alone. ``SGLANG_PLUGINS`` (SGLang's own allow-list)
selects the plugin's entry point ``disagg_ext`` or nothing, in alternating
order (0.5.10.post1, without the framework: the launcher's own ``load_plugin()``
call against none). Two settings:

* ``server``: the process that parses the command line (no backend chosen yet:
  the plugin adds the ``-ext`` names and wraps argument resolution);
* ``scheduler``: a child process with ``SGLANG_DISAGG_EXT_BACKEND=mooncake-ext``
  (the plugin also imports its Mooncake manager, routes the class and, where
  F5 is live, patches the retract path); SGLang's Mooncake backend, its
  disaggregation utilities and memory pools are pre-imported in both arms, as
  a PD scheduler has them. (``sglang.srt.managers.scheduler`` itself does not
  import on these CPU venvs: ``einops`` is not installed.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

from bench.stats import interleaved_order, median

ENTRY_POINT = "disagg_ext"
NO_PLUGIN = "__bench_no_plugin__"  # a name no entry point has: SGLang then loads none

_PROBE = r"""
import json, sys, time
import os
import sglang.srt.server_args  # noqa: F401  (imported before load_plugins in launch_server)
try:
    from sglang.srt.plugins import load_plugins
except ImportError:
    # 0.5.10.post1 has no plugin framework: sglang_disagg_ext.launch_server calls
    # the plugin's load_plugin() itself, so that call is what loading adds there.
    def load_plugins():
        if os.environ.get("SGLANG_PLUGINS") == "disagg_ext":
            from sglang_disagg_ext.registration import load_plugin
            load_plugin()
if sys.argv[1] == "scheduler":
    # A PD scheduler has its memory pools and transfer backend imported by then.
    import sglang.srt.disaggregation.mooncake.conn  # noqa: F401
    import sglang.srt.disaggregation.utils  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
t0 = time.perf_counter()
load_plugins()
dt = time.perf_counter() - t0
from sglang.srt import server_args
print(json.dumps({"seconds": dt, "ext_names": "mooncake-ext" in server_args.DISAGG_TRANSFER_BACKEND_CHOICES}))
"""


def _probe(python: str, setting: str, with_plugin: bool, timeout: float = 300.0) -> Dict[str, Any]:
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("SGLANG_DISAGG_EXT_BACKEND", "SGLANG_DISAGG_EXT_BACKEND_PID", "SGLANG_PLUGINS")
    }
    env["SGLANG_PLUGINS"] = ENTRY_POINT if with_plugin else NO_PLUGIN
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    if setting == "scheduler":
        # As the launcher hands it to a scheduler: chosen by this (parent) process.
        env.update({"SGLANG_DISAGG_EXT_BACKEND": "mooncake-ext", "SGLANG_DISAGG_EXT_BACKEND_PID": str(os.getpid())})
    r = subprocess.run([python, "-c", _PROBE, setting], capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"plugin-load probe ({setting}, plugin={with_plugin}) failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["ext_names"] != with_plugin:
        raise RuntimeError(f"probe {setting} plugin={with_plugin}: -ext names registered = {out['ext_names']}")
    return out


def measure(repeats: Dict[str, int], python: Optional[str] = None) -> List[Dict[str, Any]]:
    """``repeats``: setting -> interleaved repeats (a scheduler probe imports far more)."""
    python = python or sys.executable
    rows = []
    for setting, n in repeats.items():
        samples: Dict[str, List[float]] = {"stock": [], "ext": []}
        for _, arm in interleaved_order(["stock", "ext"], n):
            samples[arm].append(_probe(python, setting, arm == "ext")["seconds"])
        stock, ext = median(samples["stock"]), median(samples["ext"])
        rows.append({
            "case": setting,
            "stock_ms": stock * 1e3,
            "ext_ms": ext * 1e3,
            "added_ms": (ext - stock) * 1e3,
            "repeats": n,
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
        })
    return rows
