"""``python -m sglang_disagg_ext.launch_server ARGS``: ``sglang.launch_server`` with the plugin loaded.

For SGLang releases without a plugin framework (0.5.10.post1 and older) this is
the one command that activates the ``-ext`` backends; it takes exactly
``python -m sglang.launch_server``'s arguments and edits no SGLang file. It
works on newer releases too.

Why it reaches every process: SGLang starts its scheduler and detokenizer with
multiprocessing's *spawn* method, and a spawned child imports the parent's
``__main__`` module (as ``__mp_main__``) before it runs its target. The parent's
``__main__`` is this module, so the ``load_plugin()`` call below runs in every
child too, and the backend chosen in the parent reaches the child through
``SGLANG_DISAGG_EXT_BACKEND`` in the inherited environment.

``--check-routing`` parses the arguments, spawns one child the way SGLang does,
and prints (as JSON) which classes ``get_kv_class`` returns there, then exits:
an operator's check that the routing is in place before starting servers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import runpy
import sys

from sglang_disagg_ext import releases
from sglang_disagg_ext.registration import load_plugin

# Runs in the launcher and, through __mp_main__, in every spawned child.
load_plugin()


def routing_report() -> dict:
    import os

    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from sglang_disagg_ext.backend_table import NAMES
    from sglang_disagg_ext.registration import SELECTED_BACKEND_ENV

    report = {"selected": os.environ.get(SELECTED_BACKEND_ENV), "classes": {}}
    for backend in NAMES:
        try:
            cls = get_kv_class(TransferBackend(backend), KVClassType.MANAGER)
        except Exception as exc:  # noqa: BLE001 - an engine missing here is a finding, not a crash
            report["classes"][backend] = f"unavailable: {exc.__class__.__name__}: {exc}"
        else:
            report["classes"][backend] = f"{cls.__module__}.{cls.__qualname__}"
    return report


def _child_report(queue) -> None:
    queue.put(routing_report())


def check_routing(argv) -> int:
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    if releases.features().server_args_resolve_once:  # releases that resolve after parsing
        server_args.resolve_once()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_report, args=(queue,))
    child.start()
    try:
        child_report = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    print(
        json.dumps(
            {
                "server_args_backend": server_args.disaggregation_transfer_backend,
                "launcher": routing_report(),
                "spawned_child": child_report,
            },
            indent=2,
        )
    )
    return 0


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--check-routing" in argv:
        argv.remove("--check-routing")
        sys.exit(check_routing(argv))
    sys.argv = ["sglang.launch_server", *argv]
    # alter_sys=False keeps this module as sys.modules["__main__"], which is what
    # spawned children import (see the module docstring).
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
