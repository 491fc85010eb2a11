"""Command line: sglang-disagg-ext doctor|selftest|launch-pd|gsm8k|tiny-model.

doctor and selftest check a node; launch-pd, gsm8k and tiny-model are the deployment
tools (sglang_disagg_ext.deploy). Also: python -m sglang_disagg_ext.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_disagg_ext import backend_table
from sglang_disagg_ext.help_text import plain_text


def _positive(kind, what: str):
    """An argparse type: a ``kind`` number above zero (``what`` names it in the refusal).

    Zero or less never makes sense for these options (no time, no requests, no ranks),
    and a value passed on would only fail later, reported as failed rows.
    """

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
        return value

    parse.__name__ = what  # argparse's fallback name in messages
    return parse


def _rate(text: str) -> float:
    """An argparse type: a share of requests, 0 <= R < 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 0 and below 1")
    return value


def _selftest_backend(text: str) -> str:
    """``--backend`` of selftest: a stock name or its ``-ext`` name, both meaning that engine
    (every row runs stock and -ext side by side)."""
    name = backend_table.ext_to_base().get(text, text)
    if name not in backend_table.NAMES:
        known = ", ".join(n for b in backend_table.BACKENDS for n in (b.name, b.ext_name))
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {known})")
    return name


def _doctor(args) -> int:
    from sglang_disagg_ext import doctor

    if args.fix:
        return doctor.print_fix(args.fix)
    if args.diff:
        return doctor.print_diff(*args.diff)
    if args.release:
        return doctor.print_release(args.release)
    report = doctor.diagnose()
    if args.json:
        keys = ("sglang_version", "supported", "fixes", "engines", "entry_point")
        # schema_version: bumped whenever a key changes meaning or goes away.
        out = {"schema_version": 2, **{k: report[k] for k in keys}}
        out.update({k: v for k, v in report.items() if k not in keys})
        print(json.dumps(out, indent=2))
    else:
        print(doctor.format_report(report))
    return doctor.exit_code(report, strict=args.strict)


def _selftest(args) -> int:
    from sglang_disagg_ext.selftest import runner as selftest

    return selftest.main(args)


# Deployment subcommands: name -> (module with main(argv), help). Their own
# parsers read everything after the subcommand name.
DEPLOY_COMMANDS = {
    "launch-pd": ("sglang_disagg_ext.deploy.launch_pd", "start/stop 1 prefill + 1 decode + router (see --help)"),
    "gsm8k": ("sglang_disagg_ext.deploy.gsm8k", "GSM8K accuracy of a running PD deployment (see --help)"),
    "tiny-model": ("sglang_disagg_ext.deploy.tiny_model", "write a tiny local model folder for CPU checks"),
}


def _deploy(name: str, argv) -> int:
    import importlib

    module, _ = DEPLOY_COMMANDS[name]
    return int(importlib.import_module(module).main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    from sglang_disagg_ext import build_info, releases

    parser = argparse.ArgumentParser(prog="sglang-disagg-ext", description=plain_text(__doc__))
    parser.add_argument(
        "--version", action="version",
        version=f"%(prog)s {build_info.version_line()} (SGLang {releases.installed_sglang_version() or 'not installed'})",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="report SGLang release, per-fix status and engines")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--strict", action="store_true",
                   help="a deployment gate: also exit 1 when the installed SGLang is not a release the plugin has "
                        "proven (there the -ext names pass through to SGLang's own classes)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--fix", metavar="FIX", help="where fix FIX lives: core, adapter, hook, scenario, tests, doc")
    what.add_argument("--release", metavar="VERSION",
                      help="what the plugin does on SGLang VERSION (installed or not) and which CI leg proves it")
    what.add_argument("--diff", nargs=2, metavar=("A", "B"),
                      help="how two SGLang releases differ: fix statuses and recorded probe values")
    p.set_defaults(func=_doctor)

    p = sub.add_parser(
        "selftest",
        help="run the built-in transfer scenarios, stock vs -ext, on the real engines",
    )
    p.add_argument("--backend", type=_selftest_backend, action="append",
                   metavar="{%s}" % ",".join(backend_table.NAMES),
                   help="limit to these engines (repeatable); mooncake-ext, nixl-ext, mori-ext name the same "
                        "engine (each row runs stock and -ext side by side); default: every engine available here")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: release, options, rows (each with why if not run), totals")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"],
                   help="how the engines move bytes: Mooncake's TransferEngine protocol; for NIXL the UCX "
                        "transports (tcp: UCX_TLS=tcp,self,sm; rdma: rc,ud,self). Default tcp")
    p.add_argument("--device", default="cpu", metavar="{cpu,cuda,cuda:N}",
                   help="where the KV and state pools live (aux metadata buffers stay in host memory, as in "
                        "SGLang); default cpu")
    p.add_argument("--ib-device", default=None,
                   help="RDMA device(s), e.g. mlx5_0 or mlx5_0,mlx5_1 (with --protocol rdma): SGLang's "
                        "--disaggregation-ib-device for Mooncake, UCX_NET_DEVICES for NIXL")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="run only this scenario (repeatable; exact row name)")
    p.add_argument("--timeout", type=_positive(float, "a number of seconds"), default=60.0,
                   help="seconds per scenario before it counts as failed (above 0)")
    p.add_argument("--list", action="store_true",
                   help="print the scenario names for these backends and exit (with --json: one JSON list of rows, "
                        "each with its backend, fixes and whether it runs here or why not)")
    p.add_argument("--min-rows", type=_positive(int, "a whole number"), default=1,
                   help="exit 1 unless at least this many -ext rows ran (default 1: a run where every row is "
                        "n/a checks nothing)")
    p.add_argument("--ext-only", action="store_true",
                   help="run each Mooncake/NIXL scenario with the -ext name only (checks this node; "
                        "no stock comparison)")
    p.add_argument("--verify", action="store_true",
                   help="run every -ext side with verified transfers on (SGLANG_DISAGG_EXT_VERIFY=1): decode "
                        "checks a digest of every byte before Success, where the backend and release allow")
    soak = p.add_argument_group("soak", "--soak: many concurrent requests with injected faults, stock and -ext "
                                        "side by side (Mooncake or NIXL over TCP; see selftest/soak.py)")
    soak.add_argument("--soak", action="store_true", help="run the soak instead of the scenario rows")
    count = _positive(int, "a whole number")
    soak.add_argument("--requests", type=count, default=512, help="soak requests in all (default 512)")
    soak.add_argument("--wave", type=count, default=64, help="soak requests in flight at once (default 64)")
    soak.add_argument("--fault-rate", type=_rate, default=1 / 16,
                      help="Mooncake: share of soak requests whose write the engine drops; NIXL: prefill's agent "
                           "fails 1 in round(1/R) of its posts (default 1/16)")
    soak.add_argument("--bad-rate", type=_rate, default=1 / 32,
                      help="share of soak requests with a decode index outside the pool (default 1/32)")
    soak.add_argument("--duplicate-rate", type=_rate, default=1 / 32,
                      help="share of the valid soak requests that name the bootstrap room of an earlier one of "
                           "their wave (F16; one rank a side only; default 1/32)")
    soak.add_argument("--orphan-rate", type=_rate, default=1 / 64,
                      help="share of the valid soak requests prefill never admits (F17 on Mooncake, F24 on NIXL; "
                           "one rank a side, where the fix is covered; default 1/64)")
    soak.add_argument("--mismatched-rate", type=_rate, default=1 / 64,
                      help="share of the valid soak requests sent by a second decode process whose KV head dim "
                           "is twice prefill's (F18's mismatched peer; Mooncake, one rank a side; default 1/64)")
    soak.add_argument("--seed", type=int, default=0, help="soak request generator seed (default 0)")
    soak.add_argument("--no-restart", action="store_true",
                      help="keep the decode worker up (default: it is killed in the middle wave and restarted)")
    soak.add_argument("--prefill-tp", type=count, default=1,
                      help="soak prefill ranks, one process each (NIXL: 2 with --decode-tp 1; default 1)")
    soak.add_argument("--decode-tp", type=count, default=1,
                      help="soak decode ranks, one process each (NIXL: 2 with --prefill-tp 1; default 1)")
    p.set_defaults(func=_selftest)

    for name, (_, text) in DEPLOY_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)  # listed here; main() hands its argv over
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DEPLOY_COMMANDS:
        return _deploy(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
