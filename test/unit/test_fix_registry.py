"""The fix registry names real files, covers every fix, and picks a leg's tests from the table."""

import os

import pytest

from sglang_disagg_ext import fix_registry, releases

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(10)
def test_every_fix_has_an_entry_and_every_path_exists():
    assert tuple(fix_registry.REGISTRY) == releases.FIXES
    for entry in fix_registry.REGISTRY.values():
        assert entry.tests, entry.fix
        for path in entry.paths():
            assert os.path.exists(os.path.join(ROOT, path)), f"{entry.fix}: {path} does not exist"


@pytest.mark.timeout(10)
def test_a_leg_runs_the_tests_of_what_it_proves():
    got = fix_registry.tests_for(("F10", "F13"))
    assert got == ("test/unit/test_release_facts.py", "test/integration/test_metadata_gate.py",
                   "test/integration/test_nixl_swa_tp.py")
    got = fix_registry.tests_for(("F9", "F14", releases.ACTIVATION))
    assert got[:4] == ("test/unit/test_release_facts.py", "test/integration/test_mooncake_registration.py",
                       "test/unit/test_prefill_pairing.py", "test/integration/test_decode_pairing_check.py")
    # activation: node ids, each once
    assert got[4:] == fix_registry.ACTIVATION_TESTS
    # a node id whose file a fix runs whole is not run again
    assert fix_registry.tests_for(("F12", releases.ACTIVATION)).count("test/integration/test_mori_ext.py") == 1


@pytest.mark.timeout(10)
def test_activation_node_ids_name_real_tests():
    for node in fix_registry.ACTIVATION_TESTS:
        path, name = node.split("::")
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {name}(" in f.read(), node


@pytest.mark.timeout(10)
def test_describe_names_every_part():
    text = fix_registry.REGISTRY["F7"].describe()
    assert text.splitlines()[0].startswith("F7: Mooncake: hybrid state buffers paired by layer")
    assert "backends/mooncake/state_pairing.py" in text and "test_mooncake_state_pairing.py" in text
