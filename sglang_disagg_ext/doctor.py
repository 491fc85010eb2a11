"""``sglang-disagg-ext doctor``: can an ``-ext`` backend work in this environment?"""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from typing import Dict, Optional

from sglang_disagg_ext import backend_table, releases, verification
from sglang_disagg_ext.backends.common import held_pages
from sglang_disagg_ext.core.held_pages import LIMIT_ENV

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "disagg_ext"
DISTRIBUTION = "sglang-disagg-ext"

# Module each transfer engine's SGLang backend imports first.
ENGINE_MODULES = {b.name: b.engine_module for b in backend_table.BACKENDS}


def engine_importable(engine: str) -> bool:
    try:
        importlib.import_module(ENGINE_MODULES[engine])
    except Exception:  # noqa: BLE001 - a broken native library is "not importable" too
        return False
    return True


def entry_point_status(policy: releases.ReleasePolicy):
    """(discovered, reason): whether SGLang's plugin loader will run this plugin."""
    ours = [
        ep
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.name == ENTRY_POINT_NAME
    ]
    if not ours:
        return False, f"no {ENTRY_POINT_GROUP} entry point named {ENTRY_POINT_NAME} is installed"
    if policy.version is None:
        return False, "SGLang is not installed here"
    if not policy.has_plugin_framework:
        return False, (
            f"SGLang {policy.version} has no plugin framework; start servers with "
            "`python -m sglang_disagg_ext.launch_server` (same arguments as sglang.launch_server)"
        )
    whitelist = os.environ.get("SGLANG_PLUGINS", "")
    allowed = {x.strip() for x in whitelist.split(",") if x.strip()}
    if allowed and ENTRY_POINT_NAME not in allowed:
        return False, f"SGLANG_PLUGINS={whitelist!r} does not include {ENTRY_POINT_NAME}"
    return True, "discovered by SGLang's plugin loader"


def diagnose(policy: Optional[releases.ReleasePolicy] = None) -> Dict:
    policy = policy or releases.current_policy()
    engines = {name: engine_importable(name) for name in ENGINE_MODULES}
    discovered, entry_reason = entry_point_status(policy)
    fixes = {
        fix: {
            "live": policy.is_live(fix),
            # The plugin installs its fixed code exactly where the bug is live.
            "active": policy.support is releases.Support.ACTIVE and policy.is_live(fix),
            "status": policy.fixes[fix].value,
            "backend": releases.FIX_BACKEND[fix],
            # The CI leg whose run proves this fix on this release (releases.ci_matrix).
            "proven_on": (releases.proving_release(policy.version, fix, releases.ci_matrix())
                          if policy.is_live(fix) else None),
        }
        for fix in releases.FIXES
    }
    launcher_ok = policy.supported and not policy.has_plugin_framework
    backends = {
        ext: {
            "engine": engines[base],
            "ready": policy.supported and engines[base] and (discovered or launcher_ok),
        }
        for ext, base in releases.EXT_BACKENDS.items()
    }
    problems, warnings = [], []
    if policy.version is None:
        import sys

        problems.append(f"SGLang is not installed in {sys.executable}: install SGLang first (the plugin runs inside "
                        "it), then this plugin, in the same environment")
    elif not policy.supported:
        problems.append(
            f"SGLang {policy.version} is not supported; supported: {releases.SUPPORTED_RANGE_TEXT}"
        )
    if policy.supported and not discovered and not launcher_ok:
        problems.append(entry_reason)
    if not policy.known:
        warnings.append(policy.unknown_release_warning())
    if verification.invalid_setting():
        problems.append(verification.invalid_setting())
    if held_pages.invalid_setting():
        problems.append(held_pages.invalid_setting())
    if policy.supported and not any(engines.values()):
        problems.append(f"no transfer engine ({', '.join(backend_table.NAMES)}) imports here")
    return {
        "sglang_version": policy.version,
        "supported": policy.supported,
        # The release is in the table (or has its base release's code) and its fixes are proven.
        "proven_release": policy.supported and policy.known,
        "support": policy.support_text,
        "state_layout": policy.layout.value if policy.layout else None,
        "fixes": fixes,
        # Fixes the SGLang sources carry from patches/ (reported as upstream above).
        "patched_sources": list(policy.patched),
        "engines": engines,
        "entry_point": discovered,
        "entry_point_detail": entry_reason,
        "backends": backends,
        "problems": problems,
        "warnings": warnings,
        "plugin_version": _plugin_version(),
        # SGLANG_DISAGG_EXT_VERIFY: on/off here, and per -ext backend why it cannot verify ("" = it can).
        "verified_transfers": {"enabled": verification.enabled(), "mode": verification.mode(),
                               "env": verification.VERIFY_ENV,
                               "unavailable": verification.available(policy)},
        # F21: how long a failed request's pages may be held for a prefill that never confirms (None: until it does).
        "held_pages_limit": {"env": LIMIT_ENV, "seconds": held_pages.limit_s()},
    }


def print_fix(fix: str) -> int:
    from sglang_disagg_ext import fix_registry

    entry = fix_registry.REGISTRY.get(fix.upper())
    if entry is None:
        print(f"doctor: no fix {fix!r}; known: {', '.join(releases.FIXES)}")
        return 2
    print(entry.describe())
    ci = releases.ci_matrix()
    for version in releases._ACTIVE_RELEASES:
        status = releases.policy_for(version).fixes[entry.fix]
        proof = releases.proving_release(version, entry.fix, ci) if status is releases.FixStatus.LIVE else None
        print(f"  {version:<14} {status.value:<18} {'proven on the ' + proof + ' CI leg' if proof else ''}")
    return 0


def release_lines(version: str) -> list:
    """One line per fix: its status on ``version`` and the CI leg whose run proves it there."""
    policy = releases.policy_for(version)
    ci = releases.ci_matrix()
    rep = releases.family_of(version)
    family = releases.families().get(rep, ()) if rep else ()
    lines = [f"SGLang {version}: {policy.support_text}; "
             + (f"same code as {', '.join(v for v in family if v != version)}" if len(family) > 1 else
                "its own release family" if family else "no recorded probe values: no CI leg proves its code")]
    for fix in releases.FIXES:
        status = policy.fixes[fix]
        proof = releases.proving_release(version, fix, ci) if status is releases.FixStatus.LIVE else None
        note = f"proven on the {proof} CI leg" if proof else ""
        lines.append(f"  {fix:<4} {releases.FIX_BACKEND[fix]:<9} {status.value:<18} {note}")
    return lines


def print_release(version: str) -> int:
    if version not in releases._ACTIVE_RELEASES:
        policy = releases.policy_for(version)
        print(f"SGLang {version}: {policy.support_text} (not in the policy table)")
        return 1
    print("\n".join(release_lines(version)))
    return 0


def print_diff(a: str, b: str) -> int:
    pa, pb = releases.policy_for(a), releases.policy_for(b)
    print(f"SGLang {a} vs {b}")
    for fix in releases.FIXES:
        if pa.fixes[fix] != pb.fixes[fix]:
            print(f"  {fix:<4} {pa.fixes[fix].value} -> {pb.fixes[fix].value}")
    diffs = releases.probe_differences(a, b)
    for name, (va, vb) in diffs.items():
        scope = ", ".join(releases.PROBE_SCOPE.get(name, ())) or "self-test rig"
        print(f"  {name}: {va!r} -> {vb!r}  ({scope})")
    if not diffs and all(pa.fixes[f] == pb.fixes[f] for f in releases.FIXES):
        print("  no difference in fix statuses or recorded probe values")
    return 0


def _plugin_version() -> Optional[str]:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def exit_code(report: Dict, strict: bool = False) -> int:
    """Non-zero when no ``-ext`` backend can work here; with ``strict`` (a deployment gate) also
    when the installed release is not one the plugin has proven (its -ext names pass through)."""
    if report["problems"]:
        return 1
    if strict and not report["proven_release"]:
        return 1
    return 0 if any(b["ready"] for b in report["backends"].values()) else 1


def format_report(report: Dict) -> str:
    yes_no = {True: "yes", False: "no"}
    lines = [
        f"SGLang:       {report['sglang_version'] or '(not installed)'} "
        f"({report['support']}, state layout {report['state_layout'] or '-'})",
        f"plugin:       sglang-disagg-ext {report['plugin_version'] or '(not installed)'}",
        f"patched:      {', '.join(report['patched_sources']) or 'no'} (fixes from patches/ in the SGLang sources)",
        f"entry point:  {yes_no[report['entry_point']]} ({report['entry_point_detail']})",
        "engines:      "
        + ", ".join(f"{name} {yes_no[ok]}" for name, ok in report["engines"].items()),
        "",
        "fix  backend   in this release    plugin activates",
    ]
    for fix, info in report["fixes"].items():
        lines.append(
            f"{fix:<4} {info['backend']:<9} {info['status']:<18} {yes_no[info['active']]:<5} "
            f"{releases.FIX_TITLES[fix]}"
        )
    verify = report["verified_transfers"]
    can = [ext for ext, why in verify["unavailable"].items() if not why]
    lines.append("")
    mode = {"off": "off", "on": "on (a room without a digest succeeds, counted unverified)",
            "require": "require (a room without every prefill rank's digest ends Failed)"}[verify["mode"]]
    lines.append(f"verified transfers: {mode} ({verify['env']}=1 turns them on, =require fails closed); "
                 f"available here for: {', '.join(can) or 'none'}")
    for ext, why in verify["unavailable"].items():
        if why:
            lines.append(f"  {ext}: {why}")
    limit = report["held_pages_limit"]
    held = "until prefill confirms or exits" if limit["seconds"] is None else f"at most {limit['seconds']:g} s"
    lines.append(f"held pages (F21): {held} ({limit['env']} caps it, without proof)")
    lines.append("")
    passing = report["support"].endswith("pass-through")
    for ext, info in report["backends"].items():
        state = "not ready" if not info["ready"] else (
            "ready (passes through to SGLang's own classes: no fix active)" if passing else "ready")
        lines.append(f"{ext:<13} {state}")
    for warning in report.get("warnings", []):
        lines.append(f"WARNING: {warning}")
    for problem in report["problems"]:
        lines.append(f"PROBLEM: {problem}")
    return "\n".join(lines)
