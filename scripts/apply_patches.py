#!/usr/bin/env python3
"""Apply ``patches/<release>/`` to a scratch copy of that SGLang release's sources.

    scripts/apply_patches.py <release> <scratch_dir>     # copy + apply
    scripts/apply_patches.py <release> --check           # do all patches still apply?

The sources are the ``sglang`` package of the pinned release, taken from the
project's venv for it (``.venv-<release>``, or ``.venv`` when that holds the
release), from ``--python <interpreter>``, or from ``--source <dir>`` (an
``sglang`` package directory or the site-packages holding one). Their version
(``sglang/_version.py``, what ``sglang/version.py`` reads) must be the release.

Apply: ``<scratch_dir>`` must be empty or absent; the package is copied to
``<scratch_dir>/sglang`` (no ``__pycache__``) and every ``*.patch`` is applied in
name order with ``patch -p1 --forward --batch --fuzz=0``. Put ``<scratch_dir>`` first on
``PYTHONPATH`` to run the patched sources.

Check: the files the patches touch are copied to a temporary directory and the
patches applied there in order (later patches build on earlier ones, so a
per-patch ``--dry-run`` would not do); nothing else is written. A patch that no
longer applies fails with its name, patch's output and the rejected hunk.

Exit status: 0 ok, 1 a patch does not apply, 2 bad input (unknown release,
non-empty scratch dir, sources of another release, no ``patch`` program).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PATCHES_DIR = os.path.join(REPO, "patches")

# Paths in a patch are relative to site-packages: "+++ b/sglang/srt/...".
_TARGET = re.compile(r"^\+\+\+ b/(\S+)", re.M)


class PatchError(Exception):
    """A patch does not apply (exit status 1)."""


class InputError(Exception):
    """The request cannot be served as given (exit status 2)."""


def releases_with_patches(patches_dir: str) -> List[str]:
    if not os.path.isdir(patches_dir):
        return []
    return sorted(
        d for d in os.listdir(patches_dir) if os.path.isdir(os.path.join(patches_dir, d)) and _patch_files(os.path.join(patches_dir, d))
    )


def _patch_files(release_dir: str) -> List[str]:
    return sorted(os.path.join(release_dir, f) for f in os.listdir(release_dir) if f.endswith(".patch"))


def patches_for(release: str, patches_dir: str = DEFAULT_PATCHES_DIR) -> List[str]:
    release_dir = os.path.join(patches_dir, release)
    files = _patch_files(release_dir) if os.path.isdir(release_dir) else []
    if not files:
        known = ", ".join(releases_with_patches(patches_dir)) or "none"
        raise InputError(f"no patches for SGLang {release} in {patches_dir}; releases with patches: {known}")
    return files


def sglang_version(package_dir: str) -> str:
    """The version string in ``<package_dir>/_version.py`` (generated at build time)."""
    path = os.path.join(package_dir, "_version.py")
    if not os.path.isfile(path):
        raise InputError(f"{package_dir} has no _version.py: not an installed SGLang package")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in ("__version__", "version") for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, str):
                return value
    raise InputError(f"{path}: no version string assigned to __version__")


def _package_of_python(python: str) -> str:
    # -I: ignore PYTHONPATH, so a patched copy on it cannot stand in for the pinned wheel.
    code = "import importlib.util as u; s = u.find_spec('sglang'); print(list(s.submodule_search_locations)[0] if s else '')"
    try:
        out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise InputError(f"cannot ask {python} where sglang is installed: {e}") from e
    path = out.stdout.strip()
    if not path:
        raise InputError(f"{python} has no sglang package installed")
    return path


def find_sources(release: str, source: Optional[str] = None, python: Optional[str] = None) -> str:
    """The ``sglang`` package directory of ``release``; checks its version."""
    if source:
        candidates = [os.path.join(source, "sglang"), source]
        package = next((c for c in candidates if os.path.isfile(os.path.join(c, "__init__.py")) and os.path.basename(os.path.normpath(c)) == "sglang"), None)
        if package is None:
            raise InputError(f"--source {source}: neither it nor {candidates[0]} is an sglang package directory")
    elif python:
        package = _package_of_python(python)
    else:
        venvs = [os.path.join(REPO, f".venv-{release}"), os.path.join(REPO, ".venv")]
        package = None
        for venv in venvs:
            py = os.path.join(venv, "bin", "python")
            if os.path.exists(py):
                found = _package_of_python(py)
                if sglang_version(found) == release:
                    package = found
                    break
        if package is None:
            raise InputError(
                f"no venv with SGLang {release} (looked in {', '.join(venvs)}); "
                f"build one with `make setup SGLANG={release}` or pass --python / --source"
            )
    found_version = sglang_version(package)
    if found_version != release:
        raise InputError(f"{package} is SGLang {found_version}, not {release}: these patches are for {release} only")
    return os.path.abspath(package)


def _targets(patch_file: str) -> List[str]:
    with open(patch_file, encoding="utf-8") as f:
        return _TARGET.findall(f.read())


def _apply_one(patch_file: str, root: str) -> None:
    """``patch -p1`` one file into ``root``; PatchError with the rejected hunk on failure."""
    with tempfile.TemporaryDirectory(prefix="apply-patches-rej-") as tmp:
        rej = os.path.join(tmp, "rejected.rej")
        # --fuzz=0: every context line must match (line offsets are fine); a patch
        # that needs fuzz is reported, not silently bent into place.
        cmd = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "-r", rej, "-d", root, "-i", patch_file]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except FileNotFoundError as e:
            raise InputError("the `patch` program is not installed (Debian: apt-get install patch)") from e
        if proc.returncode == 0:
            return
        rejected = ""
        if os.path.exists(rej):
            with open(rej, encoding="utf-8", errors="replace") as f:
                rejected = f.read()
        output = (proc.stdout + proc.stderr).strip()
        raise PatchError(
            f"{os.path.basename(patch_file)} does not apply:\n{output}"
            + (f"\nrejected hunk(s):\n{rejected.rstrip()}" if rejected else "")
        )


def check(release: str, package: str, patches: List[str]) -> None:
    """Apply every patch in order to temporary copies of the files they touch."""
    site = os.path.dirname(package)
    with tempfile.TemporaryDirectory(prefix=f"check-patches-{release}-") as root:
        for patch_file in patches:
            for rel in _targets(patch_file):
                src, dst = os.path.join(site, rel), os.path.join(root, rel)
                if os.path.isfile(src) and not os.path.exists(dst):
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copy2(src, dst)
        for patch_file in patches:
            _apply_one(patch_file, root)


def apply(release: str, package: str, patches: List[str], scratch: str) -> str:
    if os.path.exists(scratch) and (not os.path.isdir(scratch) or os.listdir(scratch)):
        raise InputError(f"scratch dir {scratch} is not empty; give a new or empty directory")
    os.makedirs(scratch, exist_ok=True)
    dest = os.path.join(scratch, "sglang")
    shutil.copytree(package, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for patch_file in patches:
        _apply_one(patch_file, scratch)
    return dest


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", help="SGLang release, e.g. 0.5.11 (a directory under patches/)")
    ap.add_argument("scratch_dir", nargs="?", help="empty directory to receive the patched sglang package")
    ap.add_argument("--check", action="store_true", help="only check that every patch applies; writes nothing")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--source", help="sglang package directory (or the site-packages holding it)")
    where.add_argument("--python", help="interpreter whose installed sglang to use")
    ap.add_argument("--patches-dir", default=DEFAULT_PATCHES_DIR, help="default: the repository's patches/")
    args = ap.parse_args(argv)
    try:
        if args.check and args.scratch_dir:
            raise InputError("--check writes nothing; drop the scratch dir argument")
        if not args.check and not args.scratch_dir:
            raise InputError("give a scratch dir to apply into, or --check")
        patches = patches_for(args.release, args.patches_dir)
        package = find_sources(args.release, args.source, args.python)
        names = ", ".join(os.path.basename(p) for p in patches)
        if args.check:
            check(args.release, package, patches)
            print(f"ok: {len(patches)} patches apply to SGLang {args.release} at {package}: {names}")
        else:
            dest = apply(args.release, package, patches, os.path.abspath(args.scratch_dir))
            print(f"applied {len(patches)} patches to {dest} (SGLang {args.release}): {names}")
            print(f"run with: PYTHONPATH={os.path.dirname(dest)}")
    except PatchError as e:
        print(f"apply_patches: SGLang {args.release}: {e}", file=sys.stderr)
        return 1
    except InputError as e:
        print(f"apply_patches: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
