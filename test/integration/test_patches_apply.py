"""patches/<release>/ against the SGLang installed in this venv (runs in every venv of the matrix).

Every patch for the installed release must still apply to its pinned sources
(``scripts/apply_patches.py --check``), and a full apply must produce sources
that the plugin recognises as patched: ``releases.current_policy()`` run with
the patched copy first on ``PYTHONPATH`` reports the patched fixes as upstream
(so the plugin installs nothing for them). Whether the patched code *works* is
what ``make test-patched`` shows: the differential tests with stock SGLang on
the patched sources.
"""

import json
import os
import subprocess
import sys

import pytest

from sglang_disagg_ext import releases

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "apply_patches.py")
VERSION = releases.installed_sglang_version()
RELEASE_DIR = os.path.join(REPO, "patches", VERSION or "-")

# What each release's marker patch must list: the fixes live there
# (releases.py table / README), for which the patches carry code.
EXPECTED_APPLIED = {
    "0.5.10.post1": ("F1", "F2", "F4", "F5"),
    "0.5.11": ("F2", "F4", "F5"),
    "0.5.12.post1": ("F3", "F4", "F5"),
    "0.5.23": ("F6", "F7", "F8", "F9", "F10", "F14", "F15", "F20", "F21", "F22"),
}

needs_patches = pytest.mark.skipif(
    not os.path.isdir(RELEASE_DIR),
    reason=f"SGLang {VERSION} has no patches/ directory (patches exist for "
    f"{', '.join(sorted(d for d in os.listdir(os.path.join(REPO, 'patches')) if not d.startswith('.')))})",
)


def installed_package() -> str:
    # find_spec does not import sglang (seconds); -I keeps any PYTHONPATH copy out.
    out = subprocess.run(
        [sys.executable, "-I", "-c", "import importlib.util as u; print(list(u.find_spec('sglang').submodule_search_locations)[0])"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return out.stdout.strip()


@needs_patches
@pytest.mark.timeout(120)
def test_every_patch_applies_to_the_installed_release():
    patches = sorted(f for f in os.listdir(RELEASE_DIR) if f.endswith(".patch"))
    proc = subprocess.run(
        [sys.executable, SCRIPT, VERSION, "--check", "--source", installed_package()],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"ok: {len(patches)} patches apply to SGLang {VERSION}" in proc.stdout
    for name in patches:
        assert name in proc.stdout


@needs_patches
@pytest.mark.timeout(240)
def test_patched_copy_is_recognised_by_the_plugin(tmp_path):
    scratch = tmp_path / "patched"
    proc = subprocess.run(
        [sys.executable, SCRIPT, VERSION, str(scratch), "--source", installed_package()],
        capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stderr
    marker = scratch / "sglang" / "srt" / "disaggregation" / "_disagg_ext_patches.py"
    assert marker.is_file()

    code = (
        "import json; from sglang_disagg_ext import releases as r; p = r.current_policy(); "
        "print(json.dumps({'patched': list(p.patched), 'fixes': {k: v.value for k, v in p.fixes.items()}}))"
    )
    env = dict(os.environ, PYTHONPATH=str(scratch))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    seen = json.loads(out.stdout)
    stock = releases.policy_for(VERSION)
    assert VERSION in EXPECTED_APPLIED, f"patches/{VERSION}/ exists: add its fixes to EXPECTED_APPLIED"
    assert tuple(seen["patched"]) == EXPECTED_APPLIED[VERSION]
    for fix in seen["patched"]:
        assert stock.fixes[fix] is releases.FixStatus.LIVE
        assert seen["fixes"][fix] == "upstream"
    # Fixes the patches do not carry keep their stock status.
    for fix, status in stock.fixes.items():
        if fix not in seen["patched"]:
            assert seen["fixes"][fix] == status.value
