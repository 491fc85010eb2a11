"""An SGLang release the plugin has not proven: doctor claims nothing, --strict fails, a server warns.

The installed SGLang's version is faked the narrowest way: a ``sglang-<version>.dist-info`` folder
(only its METADATA) first on ``PYTHONPATH``, so ``importlib.metadata.version("sglang")`` answers
that version while the real SGLang package is what imports. Two fakes: 0.5.24 (newer than every
release the plugin knows) and 0.5.21.post1 (a post-release the table does not list, whose probe
values are the installed release's, not 0.5.21's, unless 0.5.21 is installed).
"""

import json
import os
import subprocess
import sys

import pytest

from sglang_disagg_ext import releases

CHILD_SERVER_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
from sglang_disagg_ext import registration
registration.load_plugin()
registration.activate("mooncake-ext")
"""


def fake_env(tmp_path, version):
    info = tmp_path / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(tmp_path) + (os.pathsep + path if path else ""))


def run(args, env, timeout=180):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


FAKES = ["0.5.24"] + (["0.5.21.post1"] if releases.installed_sglang_version() != "0.5.21" else [])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", FAKES)
def test_doctor_claims_nothing_and_strict_fails(tmp_path, version):
    env = fake_env(tmp_path, version)
    # One JSON run with --strict (each doctor run imports SGLang: tens of seconds under CI's load).
    strict = run(["-m", "sglang_disagg_ext.cli", "doctor", "--json", "--strict"], env)
    assert strict.returncode == 1, strict.stdout
    report = json.loads(strict.stdout)
    assert report["sglang_version"] == version
    assert report["proven_release"] is False
    assert {f["status"] for f in report["fixes"].values()} == {"not covered here"}
    assert not any(f["active"] or f["live"] for f in report["fixes"].values())
    assert any(f"SGLang {version} is " in w and "no fix is active" in w for w in report["warnings"]), report["warnings"]
    text = run(["-m", "sglang_disagg_ext.cli", "doctor"], env)
    assert "upstream" not in text.stdout and "not covered here" in text.stdout
    assert "passes through to SGLang's own classes: no fix active" in text.stdout
    # Without --strict the -ext names still work (pass-through), so a plain doctor does not fail the node.
    assert text.returncode == 0, text.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", FAKES)
def test_a_server_starting_there_logs_one_warning_naming_the_release(tmp_path, version):
    out = run(["-c", CHILD_SERVER_START], fake_env(tmp_path, version))
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARNING") and f"SGLang {version}" in line]
    assert len(warnings) == 1, out.stdout
    assert "no fix is active" in warnings[0]
    assert "mooncake-ext -> stock mooncake classes (pass-through)" in out.stdout


@pytest.mark.timeout(600)
def test_the_installed_release_passes_strict():
    out = run(["-m", "sglang_disagg_ext.cli", "doctor", "--strict", "--json"], dict(os.environ))
    report = json.loads(out.stdout)
    assert report["proven_release"] is True and out.returncode == 0, out.stdout[-2000:]
