"""Release policy: the one place that knows how SGLang releases differ.

For each supported SGLang release this module says, per fix, whether the bug is
*live* (the plugin installs its fixed code), *upstream* (the release already has
the fix) or *n/a* (the code path does not exist), and which state layout the
release uses. Everything else in the plugin asks this module instead of
comparing version strings itself.

Facts come from reading each release's wheel (``shared/notes/sglang-releases.md``):

===============  ====  ====  ====  ====  ====  ==============
release           F1    F2    F3    F4    F5   state layout
===============  ====  ====  ====  ====  ====  ==============
0.5.10.post1      live  live  n/a   live  live  flat
0.5.11            up    live  n/a   live  live  flat
0.5.12(.post1)    up    up    live  live  live  per-component
0.5.13 … 0.5.23   up    up    up    up    up    per-component
===============  ====  ====  ====  ====  ====  ==============

0.5.12.x fixes F4 and F5 only in part (0.5.12.post1 lines): NIXL maps decode-side
head replicas by modulo (nixl/conn.py:1002-1004), keys KV tags on the TP rank only
(:661-662) and registers KV/state as VRAM (:776, :802); the NSA offload
``get_cpu_copy(self, indices)`` (mem_cache/memory_pool.py:2145) is called with
``mamba_indices=`` by the allocator (allocator.py:524): TypeError on retract.

Patched sources: a team that applies ``patches/<release>/`` to its SGLang gets a
``sglang/srt/disaggregation/_disagg_ext_patches.py`` listing ``APPLIED_FIXES``.
:func:`current_policy` reads it and reports those fixes as ``upstream`` (listed in
``ReleasePolicy.patched``): the patched release has the fix, so the plugin installs
nothing for it and the differential tests expect stock to pass (docs/patches.md).

F2 on the flat layout: no release has a ``"dsv4"`` state type, but a flat-layout
DSv4 component (what upstream main briefly had) is silently dropped by stock
``maybe_send_extra`` (``return 0``), so the plugin routes it: live there.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.util
import os
import sys
from importlib import metadata
from typing import Dict, Optional, Tuple

from packaging.version import InvalidVersion, Version

FIXES = ("F1", "F2", "F3", "F4", "F5")

FIX_TITLES = {
    "F1": "Mooncake SWA/NSA state-index alignment (trim both directions, request untouched)",
    "F2": "Mooncake DSv4 state routed through the generic page path",
    "F3": "MoRI per-component hybrid state (wire format, registration, dispatch)",
    "F4": "NIXL heterogeneous TP: total-head slice with GQA replication, per-rank notification key",
    "F5": "Retract/resume: metadata buffers copied, NSA index-key buffer offloaded and released",
}

# Which backend each fix lives in ("all" = not tied to one transfer backend).
FIX_BACKEND = {"F1": "mooncake", "F2": "mooncake", "F3": "mori", "F4": "nixl", "F5": "all"}

EXT_BACKENDS = {"mooncake-ext": "mooncake", "nixl-ext": "nixl", "mori-ext": "mori"}

SUPPORTED_RANGE_TEXT = (
    "0.5.10.post1, 0.5.11, 0.5.12, 0.5.12.post1 (fixes active) and "
    "0.5.13 through 0.5.23 (pass-through to the stock classes)"
)


class FixStatus(str, enum.Enum):
    LIVE = "live"
    UPSTREAM = "upstream"
    NA = "n/a"


class StateLayout(str, enum.Enum):
    FLAT = "flat"  # kv_args.state_type: str; one state component
    PER_COMPONENT = "per-component"  # kv_args.state_types: List[StateType]


class Support(str, enum.Enum):
    ACTIVE = "active"  # live fixes are installed
    PASS_THROUGH = "pass-through"  # -ext names map to the stock classes
    UNSUPPORTED = "unsupported"


class UnsupportedSGLangRelease(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ReleasePolicy:
    version: Optional[str]
    support: Support
    layout: Optional[StateLayout]
    fixes: Dict[str, FixStatus]
    has_plugin_framework: bool
    # Fixes the installed SGLang sources carry from this project's patches/
    # (their status is UPSTREAM: the plugin installs nothing for them).
    patched: Tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        return self.support is not Support.UNSUPPORTED

    @property
    def server_module(self) -> str:
        """Module that starts an SGLang server with the ``-ext`` backends loaded.

        Without a plugin framework SGLang never loads the entry point, so the
        plugin's launcher (same arguments as ``sglang.launch_server``) does it.
        """
        if self.has_plugin_framework:
            return "sglang.launch_server"
        return "sglang_disagg_ext.launch_server"

    def is_live(self, fix: str) -> bool:
        return self.fixes.get(fix) is FixStatus.LIVE

    def active_fixes(self):
        """Fixes whose fixed code the plugin installs in this release."""
        return [f for f in FIXES if self.is_live(f)]

    def check_supported(self) -> None:
        if not self.supported:
            raise UnsupportedSGLangRelease(
                f"sglang-disagg-ext does not support SGLang {self.version or '(not installed)'}; "
                f"supported releases: {SUPPORTED_RANGE_TEXT}. "
                "Use the stock backend name (mooncake, nixl, mori) or install a supported SGLang."
            )

    def summary_line(self) -> str:
        fixes = ", ".join(f"{f}={self.fixes[f].value}" for f in FIXES)
        patched = f" (patched sources: {', '.join(self.patched)})" if self.patched else ""
        return f"sglang-disagg-ext: SGLang {self.version} ({self.support.value}); {fixes}{patched}"


_L, _U, _N = FixStatus.LIVE, FixStatus.UPSTREAM, FixStatus.NA

_ACTIVE_RELEASES = {
    "0.5.10.post1": (StateLayout.FLAT, {"F1": _L, "F2": _L, "F3": _N, "F4": _L, "F5": _L}, False),
    "0.5.11": (StateLayout.FLAT, {"F1": _U, "F2": _L, "F3": _N, "F4": _L, "F5": _L}, True),
    "0.5.12": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _L, "F4": _L, "F5": _L}, True),
    "0.5.12.post1": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _L, "F4": _L, "F5": _L}, True),
}

_PASS_THROUGH_MIN = Version("0.5.13")
_PASS_THROUGH_END = Version("0.5.24")  # exclusive: 0.5.23.postN is still in


def policy_for(version: Optional[str]) -> ReleasePolicy:
    """The policy for an SGLang version string (``None``: SGLang not installed)."""
    if version in _ACTIVE_RELEASES:
        layout, fixes, has_plugins = _ACTIVE_RELEASES[version]
        return ReleasePolicy(version, Support.ACTIVE, layout, dict(fixes), has_plugins)
    parsed = None
    if version is not None:
        try:
            parsed = Version(version)
        except InvalidVersion:
            parsed = None
    if parsed is not None and not parsed.is_prerelease and not parsed.is_devrelease:
        if _PASS_THROUGH_MIN <= parsed < _PASS_THROUGH_END:
            return ReleasePolicy(
                version,
                Support.PASS_THROUGH,
                StateLayout.PER_COMPONENT,
                {f: _U for f in FIXES},
                True,
            )
    return ReleasePolicy(version, Support.UNSUPPORTED, None, {f: _N for f in FIXES}, False)


def installed_sglang_version() -> Optional[str]:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


_current: Optional[ReleasePolicy] = None


def current_policy() -> ReleasePolicy:
    """Policy of the SGLang installed in this interpreter (cached)."""
    global _current
    if _current is None:
        _current = with_patched_fixes(policy_for(installed_sglang_version()), patched_fixes())
    return _current


# Written by the last patch of each release in patches/ (scripts/apply_patches.py).
PATCH_MARKER_MODULE = "sglang.srt.disaggregation._disagg_ext_patches"


def patched_fixes(sglang_dir: Optional[str] = None) -> Tuple[str, ...]:
    """``APPLIED_FIXES`` of the SGLang sources that ``import sglang`` would load, or ``()``.

    Read from the marker file without importing SGLang (importing it costs
    seconds and must not happen as a side effect of asking for the policy);
    an already imported marker module is used as is. ``sglang_dir`` is the
    ``sglang`` package directory to look in (default: found on ``sys.path``).
    """
    module = sys.modules.get(PATCH_MARKER_MODULE)
    if module is not None and sglang_dir is None:
        fixes, where = getattr(module, "APPLIED_FIXES", ()), module.__name__
    else:
        if sglang_dir is None:
            spec = importlib.util.find_spec("sglang")
            if spec is None or not spec.submodule_search_locations:
                return ()
            sglang_dir = list(spec.submodule_search_locations)[0]
        where = os.path.join(sglang_dir, "srt", "disaggregation", "_disagg_ext_patches.py")
        if not os.path.isfile(where):
            return ()
        fixes = _read_applied_fixes(where)
    if not isinstance(fixes, (tuple, list)):
        raise ValueError(f"{where}: APPLIED_FIXES must be a tuple of fix names, got {fixes!r}")
    unknown = [f for f in fixes if f not in FIXES]
    if unknown:
        raise ValueError(f"{where}: APPLIED_FIXES has unknown fix names {unknown}; known: {FIXES}")
    return tuple(fixes)


def _read_applied_fixes(path: str) -> tuple:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "APPLIED_FIXES" for t in node.targets):
            try:
                return tuple(ast.literal_eval(node.value))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}: APPLIED_FIXES is not a literal tuple of fix names") from e
    raise ValueError(f"{path}: no APPLIED_FIXES assignment")


def with_patched_fixes(policy: ReleasePolicy, fixes) -> ReleasePolicy:
    """``policy`` with each live fix in ``fixes`` marked UPSTREAM and listed in ``patched``.

    Patched sources behave like a release that has the fix: the plugin installs
    nothing for it and stock must pass that fix's differential tests. Only
    live fixes change; a fix that is upstream or n/a here stays as it is.
    """
    changed = tuple(f for f in fixes if policy.fixes.get(f) is FixStatus.LIVE)
    if not changed:
        return policy
    statuses = dict(policy.fixes)
    for f in changed:
        statuses[f] = FixStatus.UPSTREAM
    return dataclasses.replace(policy, fixes=statuses, patched=changed)
