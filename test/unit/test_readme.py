"""The README says what the code says: its compatibility table is the release table's
(``scripts/readme_tables.py``), its links and the docs' links lead to files that exist, and it
stays short enough to read in five minutes."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import readme_tables  # noqa: E402

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.mark.timeout(30)
def test_the_compatibility_table_is_the_release_tables():
    assert readme_tables.readme_block(_read(README)) == readme_tables.block(), \
        "README's table is stale: python3 scripts/readme_tables.py --write"


@pytest.mark.timeout(30)
def test_the_table_marks_by_hand_read_rows():
    # By hand from releases.py's table: F1 is live only on 0.5.10.post1; F14 open only on 0.5.12 (no
    # CI leg); F19 fixed only on 0.5.11 and 0.5.22. A row may name several releases ("0.5.22 (CI), 0.5.23 (CI)").
    table = readme_tables.compat_table().splitlines()
    row = {}
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("| ").split(" | ")]
        for release in cells[0].split(", "):
            row[release.split(" (")[0]] = cells[1:]
    assert row["0.5.10.post1"][0] == "**fix**" and row["0.5.11"][0] == "up"
    assert row["0.5.23"][13] == "**fix**" and row["0.5.16"][13] == "**fix**" and row["0.5.12"][13] == "open"
    assert row["0.5.11"][18] == "**fix**" and row["0.5.22"][18] == "**fix**"
    assert row["0.5.23"][18] == "open" and row["0.5.10.post1"][18] == "open" and row["0.5.16"][18] == "open"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md")))
def test_relative_links_lead_to_files(path):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _read(path)):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target))):
            missing.append(target)
    assert not missing, f"{os.path.relpath(path, ROOT)}: {missing}"


@pytest.mark.timeout(30)
def test_the_readme_is_short():
    assert len(_read(README).splitlines()) <= 250


@pytest.mark.timeout(60)
def test_the_script_prints_the_table():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "readme_tables.py")],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == readme_tables.block()
