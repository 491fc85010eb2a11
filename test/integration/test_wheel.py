"""What a wheel install gets: the plugin and its self-test rig, nothing test-only.

Builds the wheel with ``pip wheel --no-deps`` from this checkout, unpacks it
into a folder of its own and runs ``sglang-disagg-ext selftest`` from there (a
folder with no ``test/``), against the SGLang of this venv: every row either
ran or says why it could not run here.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Modules that exist only for this repository's tests.
TEST_ONLY = ("tamper", "mori_standin", "sglang_standin", "conftest", "test_")


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy of what git tracks: an in-tree build/ of an earlier run
    # could still hold modules the source no longer has.
    src = out / "src"
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard"], check=True,
                           capture_output=True, text=True, timeout=60).stdout.split()
    for rel in files:
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(src / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True, timeout=300, capture_output=True,
    )
    (whl,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    target = out / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(whl)],
        check=True, timeout=300, capture_output=True,
    )
    return whl, target


@pytest.mark.timeout(400)
def test_wheel_holds_the_package_and_nothing_test_only(wheel_install):
    whl, _ = wheel_install
    names = zipfile.ZipFile(whl).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert "sglang_disagg_ext/registration.py" in modules
    assert "sglang_disagg_ext/selftest/harness/worker.py" in modules
    outside = [n for n in names if not n.startswith(("sglang_disagg_ext/", "sglang_disagg_ext-"))]
    assert outside == [], outside
    test_only = [n for n in modules if any(os.path.basename(n).startswith(t) or f"/{t}" in n for t in TEST_ONLY)]
    assert test_only == [], test_only
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


@pytest.mark.timeout(400)
def test_the_installed_wheel_answers_version_doctor_and_list(wheel_install, tmp_path):
    """What an operator runs first on a node, from the wheel alone (no checkout on the path)."""
    from sglang_disagg_ext import __version__, releases

    _, target = wheel_install
    env = dict(os.environ, PYTHONPATH=str(target))

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "sglang_disagg_ext.cli", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (args, out.stderr[-2000:])
        return out.stdout

    version = cli("--version")
    assert __version__ in version and str(releases.installed_sglang_version()) in version
    report = json.loads(cli("doctor", "--json"))
    assert report["sglang_version"] == releases.installed_sglang_version()
    assert set(report["fixes"]) == set(releases.FIXES)
    names = cli("selftest", "--list").splitlines()
    assert "swa 2 layers, decode +1" in names  # F7's row: live on every release in the matrix
    assert len(names) == len(set(names)) > 5


@pytest.mark.timeout(400)
def test_selftest_from_the_wheel_runs_or_names_each_row(wheel_install, tmp_path):
    _, target = wheel_install
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run(
        [sys.executable, "-m", "sglang_disagg_ext.cli", "selftest", "--backend", "mooncake", "--backend", "mori",
         "--scenario", "swa 3 vs 2 pages", "--scenario", "mori-hybrid-state",
         "--scenario", "transfer worker raises, then a good request", "--json",
         "--timeout", "150"],  # per run; the 60 s default is an operator's bound, not CI-under-load's
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rows = {r["scenario"]: r for r in report["rows"]}
    # The transfer row ran from the wheel's own harness.
    assert rows["swa 3 vs 2 pages"]["ext"] == "pass", rows
    # The MoRI stand-in is test-only: without a checkout the row is not run and says why.
    mori = rows["mori-hybrid-state"]
    assert mori["ext"] == "n/a" and mori["not_run"], mori
    assert report["totals"]["not_run_rows"]["mori-hybrid-state"] == mori["not_run"]
    # F8's rows need a test-only fault hook to make a thread raise: not run from a wheel, and said why.
    f8 = rows["transfer worker raises, then a good request"]
    assert f8["ext"] == "n/a" and "no source checkout" in f8["not_run"], f8
    assert report["totals"]["passed"] == report["totals"]["ran"] - report["totals"]["failed"]
    assert str(target) in subprocess.run(
        [sys.executable, "-c", "import sglang_disagg_ext; print(sglang_disagg_ext.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    ).stdout
