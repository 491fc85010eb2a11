"""The recorded probe values (release_facts.json) against the installed release, and the families.

Every CI leg runs this: a probe whose live value on the installed release differs from the
record (SGLang's code moved, or a probe changed) fails here, so a family cannot be built on
stale facts.
"""

import importlib.util
import os
import sys

import pytest

from sglang_disagg_ext import releases

# As scripts/record_release_facts.py: the MoRI stand-in answers MoRI's imports where the real
# engine (ROCm only) is absent.
STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "mori_standin")

VERSION = releases.installed_sglang_version()


@pytest.mark.timeout(120)
def test_the_installed_release_matches_its_record(monkeypatch):
    recorded = releases.recorded_facts().get(VERSION)
    assert recorded is not None, f"no probe record for SGLang {VERSION}: run scripts/record_release_facts.py"
    before = set(sys.modules)
    if importlib.util.find_spec("mori") is None:
        monkeypatch.syspath_prepend(STANDIN)  # on this test's path only
    try:
        live = releases.probe_record(releases.SGLangFeatures())  # a fresh record: nothing cached from earlier tests
    finally:
        # A later test in the same worker must not find the stand-in's "mori" (nor SGLang's MoRI
        # modules bound to it) already imported.
        for name in set(sys.modules) - before:
            if name == "mori" or name.startswith(("mori.", "sglang.srt.disaggregation.mori")):
                del sys.modules[name]
        importlib.invalidate_caches()
    assert sorted(recorded) == sorted(live), set(recorded) ^ set(live)
    differs = {k: (recorded[k], live[k]) for k in live if recorded[k] != live[k]}
    assert not differs, f"recorded vs live on {VERSION}: {differs}"


@pytest.mark.timeout(10)
def test_families_partition_the_recorded_releases():
    fams = releases.families()
    members = [v for vs in fams.values() for v in vs]
    recorded = [v for v in releases.recorded_facts() if v in releases._ACTIVE_RELEASES]
    assert sorted(members, key=releases.Version) == sorted(recorded, key=releases.Version)
    for rep, vs in fams.items():
        assert rep in vs
        keys = {releases.family_key(v) for v in vs}
        assert len(keys) == 1  # one family: identical fix statuses and probe values
        # the representative has the most live fixes of its family
        assert len(releases.policy_for(rep).active_fixes()) == max(len(releases.policy_for(v).active_fixes()) for v in vs)


@pytest.mark.timeout(10)
def test_probe_differences_name_what_differs():
    # By hand from the record: 0.5.11 and 0.5.23 differ in the server-argument resolution method.
    diff = releases.probe_differences("0.5.11", "0.5.23")
    assert diff["server_args_resolution"] == ("__post_init__", "resolve_once")
    assert releases.probe_differences("0.5.23", "0.5.23") == {}


@pytest.mark.timeout(30)
def test_every_live_fix_of_every_recorded_release_is_proven_by_a_ci_leg():
    ci = releases.ci_matrix()
    assert set(releases.FULL_LEGS) <= set(ci)
    for version in releases.recorded_facts():
        if version not in releases._ACTIVE_RELEASES:
            continue
        for fix in releases.PROVEN:
            if fix == releases.ACTIVATION or releases.policy_for(version).is_live(fix):
                leg = releases.proving_release(version, fix, ci)
                assert leg in ci, (version, fix)
                assert releases.fix_family_key(leg, fix) == releases.fix_family_key(version, fix)
                assert fix in releases.proved_on(leg), (version, fix, leg)


@pytest.mark.timeout(10)
def test_a_release_without_a_record_claims_no_fix():
    # 0.5.12 has no pin file, so no probe record: nothing live is claimed there.
    assert "0.5.12" not in releases.recorded_facts()
    policy = releases.policy_for("0.5.12")
    assert policy.active_fixes() == []
    assert policy.fixes["F3"] is releases.FixStatus.UNCOVERED


# By hand from each wheel's srt/disaggregation/utils.py (MetadataBuffers.__init__): 0.5.11 has
# neither optional buffer; 0.5.16 has the sampling mask (its `sampling_mask` rows) and no KV
# checksum; 0.5.23 has both (`kv_checksum_enabled: bool = False` at utils.py:410, `self.kv_checksum`
# at :491). These two probes gate F9's optional-buffer tests (a buffer on one side only), so a
# wrong probe would silently skip them.
OPTIONAL_BUFFERS_BY_HAND = {
    "0.5.11": {"metadata_buffers_kv_checksum": False, "metadata_buffers_sampling_mask": False},
    "0.5.16": {"metadata_buffers_kv_checksum": False, "metadata_buffers_sampling_mask": True},
    "0.5.23": {"metadata_buffers_kv_checksum": True, "metadata_buffers_sampling_mask": True},
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("version", sorted(OPTIONAL_BUFFERS_BY_HAND))
def test_the_probes_that_gate_f9_tests_match_the_wheels_read_by_hand(version):
    recorded = releases.recorded_facts()[version]
    for probe, want in OPTIONAL_BUFFERS_BY_HAND[version].items():
        assert recorded[probe] is want, (version, probe, recorded[probe])
