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
    FixEntry("F1", (_CORE + "state_plan.py", _CORE + "rate_limit.py"), (_BACK + "mooncake/conn.py",), (),
             (_SCN + "mooncake.py",), (_IT + "test_mooncake_ext.py",), "docs/fixes.md"),
    FixEntry("F2", (_CORE + "state_plan.py",), (_BACK + "mooncake/conn.py",), (),
             (_SCN + "mooncake.py",), (_IT + "test_mooncake_ext.py",), "docs/fixes.md"),
    FixEntry("F3", (_CORE + "state_wire.py", _CORE + "state_blocks.py"),
             (_BACK + "mori/conn.py", _BACK + "mori/transfer_info.py"), (),
             (_SCN + "mori.py",), (_IT + "test_mori_ext.py",), "docs/mori.md"),
    FixEntry("F4", (_CORE + "head_slice.py", _CORE + "mem_kind.py", _CORE + "nixl_notif.py", _CORE + "nixl_quorum.py"),
             (_BACK + "nixl/conn.py",), (), (_SCN + "nixl.py", _SCN + "nixl_rows.py"),
             (_IT + "test_nixl_ext.py", _IT + "test_soak_nixl.py"), "docs/nixl.md"),
    FixEntry("F5", (_CORE + "page_chunks.py",), (), (_BACK + "common/retract.py",),
             (_SCN + "f5.py",), (_IT + "test_retract_f5.py",), "docs/f5-retract.md"),
    FixEntry("F6", (_CORE + "index_bounds.py",), (_BACK + "mooncake/isolation.py", _BACK + "mooncake/peers.py"), (),
             (_SCN + "isolation.py",), (_IT + "test_mooncake_isolation.py", _IT + "test_soak_engine.py"),
             "docs/fixes.md"),
    FixEntry("F7", (_CORE + "layer_pairing.py",), (_BACK + "mooncake/state_pairing.py",), (),
             (_SCN + "state_pairing.py",), (_IT + "test_mooncake_state_pairing.py",), "docs/fixes.md"),
    FixEntry("F8", (_CORE + "thread_survival.py",), (_BACK + "mooncake/threads.py",), (),
             (_SCN + "thread_survival.py",), (_IT + "test_mooncake_threads.py",), "docs/fixes.md"),
    FixEntry("F9", (_CORE + "registration_check.py", _CORE + "index_bounds.py"),
             (_BACK + "mooncake/registration.py", _BACK + "mooncake/peers.py"), (),
             (_SCN + "registration.py",), (_IT + "test_mooncake_registration.py",),
             "docs/fixes.md"),
    FixEntry("F10", (_CORE + "gate_deadline.py",), (), (_BACK + "common/metadata_gate.py",),
             (_SCN + "metadata_gate.py",), (_IT + "test_metadata_gate.py",), "docs/fixes.md"),
    FixEntry("F11", (_CORE + "head_slice.py",), (_BACK + "nixl/head_sliced.py", _BACK + "nixl/registration.py"), (),
             (_SCN + "nixl_newest.py",), (_IT + "test_nixl_newest.py",), "docs/nixl.md"),
    FixEntry("F12", (_CORE + "aux_rows.py",), (_BACK + "mori/metadata_order.py", _BACK + "mori/aux_rows.py"), (),
             (_SCN + "mori_newest.py",), (_IT + "test_mori_newest.py", _IT + "test_mori_ext.py"), "docs/mori.md"),
    FixEntry("F13", (_CORE + "head_slice.py",), (_BACK + "nixl/swa_tp.py", _BACK + "nixl/registration.py"), (),
             (_SCN + "nixl.py",), (_IT + "test_nixl_swa_tp.py",), "docs/nixl.md"),
    FixEntry("F14", (), (_BACK + "common/prefill_pairing.py", _BACK + "common/compose.py"), (),
             (), ("test/unit/test_prefill_pairing.py", _IT + "test_decode_pairing_check.py", "test/servers/test_pd_faults.py"),
             "docs/fixes.md"),
    FixEntry("F15", (_CORE + "bootstrap_screen.py",), (_BACK + "nixl/bootstrap_screen.py",), (),
             (), ("test/unit/test_bootstrap_screen.py", _IT + "test_nixl_bootstrap_screen.py"), "docs/nixl.md"),
    FixEntry("F16", (_CORE + "room_claims.py",), (_BACK + "common/room_claims.py", _BACK + "common/compose.py"), (),
             (), ("test/unit/test_room_claims.py", _IT + "test_duplicate_rooms.py"), "docs/fixes.md"),
    FixEntry("F17", (_CORE + "dropped_rooms.py",), (_BACK + "common/dropped_rooms.py", _BACK + "common/ended_first.py",
                                                   _BACK + "mooncake/dropped_rooms.py"), (),
             (), ("test/unit/test_dropped_rooms.py", _IT + "test_mooncake_dropped_rooms.py"), "docs/fixes.md"),
    FixEntry("F18", (_CORE + "peer_record.py",), (_BACK + "mooncake/compatibility.py",), (),
             (), ("test/unit/test_peer_record.py", _IT + "test_mooncake_compatibility.py"), "docs/fixes.md"),
    # Its differential test needs two venvs: the mixed-release stage (make mixed) runs it, not a leg's test stage.
    FixEntry("F19", (_CORE + "prefill_answer.py",), (_BACK + "common/prefill_answer.py", _BACK + "common/compose.py"), (),
             (), ("test/unit/test_prefill_answer.py", "test/mixed/test_newer_prefill.py"), "docs/fixes.md"),
    FixEntry("F20", (), (_BACK + "common/prefill_lookup.py", _BACK + "common/compose.py"), (),
             (), (_IT + "test_prefill_lookup.py",), "docs/fixes.md"),
    FixEntry("F21", (_CORE + "held_pages.py",), (_BACK + "common/held_pages.py", _BACK + "common/compose.py"), (),
             (), ("test/unit/test_held_pages_rule.py", _IT + "test_held_pages.py"), "docs/fixes.md"),
    FixEntry("F22", (), (_BACK + "nixl/transfer_deadline.py", _BACK + "nixl/conn.py"), (),
             (), (_IT + "test_nixl_transfer_deadline.py",), "docs/fixes.md"),
    FixEntry("F23", (_CORE + "dropped_rooms.py",), (_BACK + "common/ended_first.py", _BACK + "nixl/conn.py"), (),
             (), ("test/unit/test_dropped_rooms.py", _IT + "test_nixl_ended_first.py"), "docs/fixes.md"),
    FixEntry("F24", (_CORE + "dropped_rooms.py",), (_BACK + "common/dropped_rooms.py", _BACK + "nixl/dropped_rooms.py",
                                                   _BACK + "nixl/conn.py"), (),
             (), ("test/unit/test_dropped_rooms.py", _IT + "test_nixl_dropped_rooms.py"), "docs/fixes.md"),
)}

# What every CI leg runs: the installed release against its recorded probe values.
ALWAYS = ("test/unit/test_release_facts.py",)
# The plugin loads and routes on a release (its -ext names parse to the base name, every
# importer of get_kv_class sees the route, doctor reads the release's facts, a transfer is
# counted; on 0.5.10.post1 through the launcher). Node ids, not whole files: a family leg proves
# activation, the full leg runs every test of these files.
ACTIVATION_TESTS = (
    _IT + "test_registration.py::test_ext_name_parses_to_base_and_routes",
    _IT + "test_registration.py::test_every_importer_sees_the_route",
    _IT + "test_registration.py::test_ext_name_takes_base_branch_at_every_string_site",
    _IT + "test_doctor.py::test_doctor_json_matches_release_facts",
    _IT + "test_metrics.py::test_a_real_transfer_exports_what_it_did",
    _IT + "test_launcher.py::test_launcher_routes_in_spawned_children_without_editing_sglang",
)


def tests_for(proven) -> Tuple[str, ...]:
    """The test paths of a leg that proves ``proven`` (fix ids and ``releases.ACTIVATION``):
    ``ALWAYS`` and each one's tests (test/servers and test/mixed excluded: those stages run on their own)."""
    out = list(ALWAYS)
    for fix in proven:
        tests = ACTIVATION_TESTS if fix == releases.ACTIVATION else REGISTRY[fix].tests
        out += [t for t in tests if not t.startswith(("test/servers/", "test/mixed/")) and t not in out]
    # A node id whose file already runs whole would run twice.
    return tuple(t for t in out if "::" not in t or t.split("::")[0] not in out)
