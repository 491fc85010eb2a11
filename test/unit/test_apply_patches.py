"""scripts/apply_patches.py on a hand-made SGLang package, and the patch marker in releases.py.

Nothing is replaced: the script runs as a subprocess with GNU ``patch``, on a
tiny ``sglang`` package written here (version ``1.0.0``) and patches written
here by hand, so these tests do not depend on the installed SGLang release.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from sglang_disagg_ext import releases

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "apply_patches.py")

MODULE = textwrap.dedent(
    """\
    def answer():
        value = 41
        return value
    """
)

GOOD_PATCH = textwrap.dedent(
    """\
    Header text: patch(1) skips everything before the first ---/+++ pair.

    --- a/sglang/srt/mod.py
    +++ b/sglang/srt/mod.py
    @@ -1,3 +1,3 @@
     def answer():
    -    value = 41
    +    value = 42
         return value
    """
)

MARKER_PATCH = textwrap.dedent(
    """\
    Marker.

    --- /dev/null
    +++ b/sglang/srt/disaggregation/_disagg_ext_patches.py
    @@ -0,0 +1 @@
    +APPLIED_FIXES = ("F2", "F4")
    """
)

# Its context line ("return result") is not in the file: the hunk is rejected.
BROKEN_PATCH = textwrap.dedent(
    """\
    Broken on purpose.

    --- a/sglang/srt/mod.py
    +++ b/sglang/srt/mod.py
    @@ -1,3 +1,3 @@
     def answer():
    -    value = 42
    +    value = 43
         return result
    """
)


def make_sglang(root, version="1.0.0"):
    pkg = root / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text(f"__version__ = version = {version!r}\n")
    (pkg / "srt" / "mod.py").write_text(MODULE)
    (pkg / "srt" / "__pycache__").mkdir()
    (pkg / "srt" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    return pkg


def make_patches(root, release="1.0.0", broken=False):
    d = root / "patches" / release
    d.mkdir(parents=True)
    (d / "0001-good.patch").write_text(GOOD_PATCH)
    if broken:
        (d / "0002-broken.patch").write_text(BROKEN_PATCH)
    (d / "0003-marker.patch").write_text(MARKER_PATCH)
    return root / "patches"


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_apply_copies_package_and_applies_every_patch_in_order(tmp_path):
    src = make_sglang(tmp_path / "site")
    patches = make_patches(tmp_path)
    scratch = tmp_path / "scratch"
    proc = run("1.0.0", scratch, "--source", src, "--patches-dir", patches)
    assert proc.returncode == 0, proc.stderr
    assert (scratch / "sglang" / "srt" / "mod.py").read_text() == MODULE.replace("41", "42")
    marker = scratch / "sglang" / "srt" / "disaggregation" / "_disagg_ext_patches.py"
    assert marker.read_text() == 'APPLIED_FIXES = ("F2", "F4")\n'
    assert not (scratch / "sglang" / "srt" / "__pycache__").exists()
    # The source package is untouched.
    assert (src / "srt" / "mod.py").read_text() == MODULE


@pytest.mark.timeout(60)
def test_check_writes_nothing(tmp_path):
    src = make_sglang(tmp_path / "site")
    patches = make_patches(tmp_path)
    proc = run("1.0.0", "--check", "--source", tmp_path / "site", "--patches-dir", patches)
    assert proc.returncode == 0, proc.stderr
    assert "ok: 2 patches apply to SGLang 1.0.0" in proc.stdout
    assert (src / "srt" / "mod.py").read_text() == MODULE
    assert not (src / "srt" / "disaggregation").exists()


@pytest.mark.timeout(60)
def test_broken_patch_is_named_with_its_rejected_hunk(tmp_path):
    src = make_sglang(tmp_path / "site")
    patches = make_patches(tmp_path, broken=True)
    proc = run("1.0.0", "--check", "--source", src, "--patches-dir", patches)
    assert proc.returncode == 1
    assert "0002-broken.patch does not apply" in proc.stderr
    assert "rejected hunk(s):" in proc.stderr
    assert "+    value = 43" in proc.stderr and "     return result" in proc.stderr
    # The patches before it applied; the one after it was never tried.
    assert "0003-marker.patch" not in proc.stderr

    scratch = tmp_path / "scratch"
    proc = run("1.0.0", scratch, "--source", src, "--patches-dir", patches)
    assert proc.returncode == 1
    assert "0002-broken.patch does not apply" in proc.stderr


@pytest.mark.timeout(60)
def test_unknown_release_lists_the_releases_with_patches(tmp_path):
    src = make_sglang(tmp_path / "site")
    patches = make_patches(tmp_path)
    proc = run("0.4.0", "--check", "--source", src, "--patches-dir", patches)
    assert proc.returncode == 2
    assert "no patches for SGLang 0.4.0" in proc.stderr
    assert "releases with patches: 1.0.0" in proc.stderr


@pytest.mark.timeout(60)
def test_repository_patch_releases_are_listed(tmp_path):
    proc = run("0.4.0", "--check")
    assert proc.returncode == 2
    listed = proc.stderr.split("releases with patches: ")[1].split()
    assert "0.5.11" in [r.rstrip(",") for r in listed]


@pytest.mark.timeout(60)
def test_non_empty_scratch_dir_is_refused(tmp_path):
    src = make_sglang(tmp_path / "site")
    patches = make_patches(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "leftover.txt").write_text("x")
    proc = run("1.0.0", scratch, "--source", src, "--patches-dir", patches)
    assert proc.returncode == 2
    assert f"scratch dir {scratch} is not empty" in proc.stderr
    assert sorted(os.listdir(scratch)) == ["leftover.txt"]


@pytest.mark.timeout(60)
def test_sources_of_another_release_are_refused(tmp_path):
    src = make_sglang(tmp_path / "site", version="1.0.1")
    patches = make_patches(tmp_path)
    proc = run("1.0.0", tmp_path / "scratch", "--source", src, "--patches-dir", patches)
    assert proc.returncode == 2
    assert "is SGLang 1.0.1, not 1.0.0" in proc.stderr
    assert not (tmp_path / "scratch").exists()


@pytest.mark.timeout(60)
def test_source_that_is_not_an_sglang_package_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    patches = make_patches(tmp_path)
    proc = run("1.0.0", "--check", "--source", tmp_path / "empty", "--patches-dir", patches)
    assert proc.returncode == 2
    assert "is an sglang package directory" in proc.stderr


@pytest.mark.timeout(60)
def test_missing_scratch_dir_and_check_with_scratch_dir_are_refused(tmp_path):
    proc = run("0.5.11")
    assert proc.returncode == 2 and "give a scratch dir" in proc.stderr
    proc = run("0.5.11", tmp_path / "x", "--check")
    assert proc.returncode == 2 and "--check writes nothing" in proc.stderr


# --------------------------------------------------------------------------
# releases.py: the marker the last patch writes
# --------------------------------------------------------------------------


def write_marker(tmp_path, text):
    pkg = tmp_path / "sglang"
    (pkg / "srt" / "disaggregation").mkdir(parents=True)
    (pkg / "srt" / "disaggregation" / "_disagg_ext_patches.py").write_text(text)
    return str(pkg)


@pytest.mark.timeout(10)
def test_patched_fixes_read_from_marker(tmp_path):
    pkg = write_marker(tmp_path, '"""doc"""\n\nAPPLIED_FIXES = ("F2", "F4", "F5")\n')
    assert releases.patched_fixes(pkg) == ("F2", "F4", "F5")


@pytest.mark.timeout(10)
def test_no_marker_means_no_patched_fixes(tmp_path):
    (tmp_path / "sglang").mkdir()
    assert releases.patched_fixes(str(tmp_path / "sglang")) == ()


@pytest.mark.timeout(10)
def test_marker_with_unknown_fix_is_refused_by_name(tmp_path):
    pkg = write_marker(tmp_path, 'APPLIED_FIXES = ("F2", "F99")\n')
    with pytest.raises(ValueError, match=r"unknown fix names \['F99'\]"):
        releases.patched_fixes(pkg)


@pytest.mark.timeout(10)
def test_marker_that_is_not_a_tuple_is_refused(tmp_path):
    pkg = write_marker(tmp_path, 'APPLIED_FIXES = "F2"\n')
    with pytest.raises(ValueError, match="unknown fix names"):
        releases.patched_fixes(pkg)  # tuple("F2") is ('F', '2'): neither is a fix
    pkg2 = write_marker(tmp_path / "b", "APPLIED_FIXES = make()\n")
    with pytest.raises(ValueError, match="not a literal tuple"):
        releases.patched_fixes(pkg2)


@pytest.mark.timeout(10)
def test_patched_live_fixes_become_upstream():
    # 0.5.11: F1 upstream, F2 live, F3 n/a, F4-F10, F12, F14-F16, F18, F19 and F20 live (releases.py table).
    policy = releases.with_patched_fixes(releases.policy_for("0.5.11"), ("F1", "F2", "F3"))
    assert policy.fixes["F1"] is releases.FixStatus.UPSTREAM
    assert policy.fixes["F2"] is releases.FixStatus.UPSTREAM
    assert policy.fixes["F3"] is releases.FixStatus.NA
    assert policy.fixes["F4"] is releases.FixStatus.LIVE
    assert policy.patched == ("F2",)  # only fixes that were live change
    assert policy.active_fixes() == ["F4", "F5", "F6", "F7", "F8", "F9", "F10", "F12", "F14", "F15", "F16", "F18", "F19", "F20"]
    assert "(patched sources: F2)" in policy.summary_line()


@pytest.mark.timeout(10)
def test_nothing_patched_keeps_the_policy():
    policy = releases.policy_for("0.5.10.post1")
    assert releases.with_patched_fixes(policy, ()) is policy
    assert policy.patched == ()


@pytest.mark.timeout(10)
def test_patched_sources_keep_the_backend_routed():
    """0.5.10.post1 with every patch: F4 is upstream (patched), yet nixl-ext keeps the plugin's
    classes over the patched sources, so the patched run checks stock and -ext both pass."""
    unpatched = releases.policy_for("0.5.10.post1")
    patched = releases.with_patched_fixes(unpatched, ("F1", "F2", "F4", "F5"))
    assert not patched.is_live("F4") and "F4" in patched.patched
    assert patched.routes("nixl") and patched.routes("mooncake")
    # ... while on 0.5.23, where F4 is upstream in SGLang itself, nixl-ext routes only for F11.
    newest = releases.policy_for("0.5.23")
    assert newest.routes("nixl") and not newest.is_live("F4") and newest.is_live("F11")
