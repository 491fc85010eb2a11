"""Where each fix lives: its pure logic, its adapter, its hook, its self-test scenario, its tests, its doc.

One record per fix id of ``releases.FIXES``; ``sglang-disagg-ext doctor --fix F7`` prints one.
Paths are relative to the repository root (the tests and docs are in a checkout, not in the
wheel). ``test/unit/test_fix_registry.py`` checks that every path exists and every fix has a
record, so the registry cannot drift from the code. CI's per-release test selection
(``scripts/ci_plan.py``) runs the ``tests`` of every fix live on a release.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from sglang_disagg_ext import releases

_PKG = "sglang_disagg_ext/"
_CORE = _PKG + "core/"
_BACK = _PKG + "backends/"
_SCN = _PKG + "selftest/scenarios/"
_IT = "test/integration/"


@dataclasses.dataclass(frozen=True)
class FixEntry:
    fix: str
    core: Tuple[str, ...]  # pure logic (no SGLang import)
    adapters: Tuple[str, ...]  # the -ext classes that call it
    hooks: Tuple[str, ...]  # functions the plugin installs into SGLang (not classes)
    scenarios: Tuple[str, ...]  # the self-test rows (selftest)
    tests: Tuple[str, ...]  # the differential tests (stock fails by the bug's signature, -ext passes)
    doc: str  # where its story is told

    @property
    def title(self) -> str:
        return releases.FIX_TITLES[self.fix]

    @property
    def backend(self) -> str:
        return releases.FIX_BACKEND[self.fix]

    def paths(self) -> Tuple[str, ...]:
        return self.core + self.adapters + self.hooks + self.scenarios + self.tests + (self.doc.split("#")[0],)

    def describe(self) -> str:
        rows = [f"{self.fix}: {self.title}", f"  backend:   {self.backend}"]
        for label, paths in (("core", self.core), ("adapters", self.adapters), ("hooks", self.hooks),
                             ("scenarios", self.scenarios), ("tests", self.tests), ("doc", (self.doc,))):
            rows.append(f"  {label + ':':<10} {', '.join(paths) if paths else '-'}")
        return "\n".join(rows)


REGISTRY: Dict[str, FixEntry] = {e.fix: e for e in (
    FixEntry("F1", (_CORE + "state_plan.py", _CORE + "rate_limit.py"), (_BACK + "mooncake.py",), (),
             (_SCN + "mooncake.py",), (_IT + "test_mooncake_ext.py",), "README.md#who-needs-it"),
    FixEntry("F2", (_CORE + "state_plan.py",), (_BACK + "mooncake.py",), (),
             (_SCN + "mooncake.py",), (_IT + "test_mooncake_ext.py",), "README.md#who-needs-it"),
    FixEntry("F3", (_CORE + "state_wire.py", _CORE + "state_blocks.py"),
             (_BACK + "mori.py", _BACK + "mori_transfer_info.py"), (),
             (_SCN + "mori.py",), (_IT + "test_mori_ext.py",), "docs/mori.md"),
    FixEntry("F4", (_CORE + "head_slice.py", _CORE + "mem_kind.py", _CORE + "nixl_notif.py", _CORE + "nixl_quorum.py"),
             (_BACK + "nixl.py",), (), (_SCN + "nixl.py", _SCN + "nixl_rows.py"),
             (_IT + "test_nixl_ext.py", _IT + "test_soak_nixl.py"), "docs/nixl.md"),
    FixEntry("F5", (_CORE + "page_chunks.py",), (), (_BACK + "retract.py",),
             (_SCN + "f5.py",), (_IT + "test_retract_f5.py",), "docs/f5-retract.md"),
    FixEntry("F6", (_CORE + "index_bounds.py",), (_BACK + "mooncake_isolation.py", _BACK + "mooncake_peers.py"), (),
             (_SCN + "isolation.py",), (_IT + "test_mooncake_isolation.py", _IT + "test_soak_engine.py"),
             "README.md#who-needs-it"),
    FixEntry("F7", (_CORE + "layer_pairing.py",), (_BACK + "mooncake_state_pairing.py",), (),
             (_SCN + "state_pairing.py",), (_IT + "test_mooncake_state_pairing.py",), "README.md#who-needs-it"),
    FixEntry("F8", (_CORE + "thread_survival.py",), (_BACK + "mooncake_threads.py",), (),
             (_SCN + "thread_survival.py",), (_IT + "test_mooncake_threads.py",), "README.md#who-needs-it"),
    FixEntry("F9", (_CORE + "registration_check.py", _CORE + "index_bounds.py"),
             (_BACK + "mooncake_registration.py", _BACK + "mooncake_peers.py"), (),
             (_SCN + "registration.py",), (_IT + "test_mooncake_registration.py", _IT + "test_registration.py"),
             "README.md#who-needs-it"),
    FixEntry("F10", (_CORE + "gate_deadline.py",), (), (_BACK + "metadata_gate.py",),
             (_SCN + "metadata_gate.py",), (_IT + "test_metadata_gate.py",), "README.md#who-needs-it"),
    FixEntry("F11", (_CORE + "head_slice.py",), (_BACK + "nixl_newest.py", _BACK + "nixl_registration.py"), (),
             (_SCN + "nixl_newest.py",), (_IT + "test_nixl_newest.py",), "docs/nixl.md"),
    FixEntry("F12", (_CORE + "aux_rows.py",), (_BACK + "mori_newest.py", _BACK + "mori_aux_rows.py"), (),
             (_SCN + "mori_newest.py",), (_IT + "test_mori_newest.py", _IT + "test_mori_ext.py"), "docs/mori.md"),
    FixEntry("F13", (_CORE + "head_slice.py",), (_BACK + "nixl_swa_tp.py", _BACK + "nixl_registration.py"), (),
             (_SCN + "nixl.py",), (_IT + "test_nixl_swa_tp.py",), "docs/nixl.md"),
    FixEntry("F14", (), (_BACK + "prefill_pairing.py", _BACK + "common_fixes.py"), (),
             (), ("test/unit/test_prefill_pairing.py", "test/servers/test_pd_faults.py"), "README.md#who-needs-it"),
)}

# What every CI leg runs: the installed release against its recorded probe values.
ALWAYS = ("test/unit/test_release_facts.py",)
# releases.ACTIVATION: the -ext name taken, routed and reported.
ACTIVATION_TESTS = (_IT + "test_registration.py", _IT + "test_doctor.py", _IT + "test_metrics.py")


def tests_for(proven) -> Tuple[str, ...]:
    """The test paths of a leg that proves ``proven`` (fix ids and ``releases.ACTIVATION``):
    ``ALWAYS`` and each one's tests (test/servers excluded: that stage runs on its own)."""
    out = list(ALWAYS)
    for fix in proven:
        tests = ACTIVATION_TESTS if fix == releases.ACTIVATION else REGISTRY[fix].tests
        out += [t for t in tests if not t.startswith("test/servers/") and t not in out]
    return tuple(out)
