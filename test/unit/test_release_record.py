"""scripts/release_record.py: the CI record is read from .ci/run's logs, never typed by hand.
The logs below are written by hand in .ci/run's formats; the expected rows are worked out from them."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("release_record", os.path.join(ROOT, "scripts", "release_record.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LOG = """--- ci-release 0.5.23: test ---
SKIPPED [2] test/e2e/test_gsm8k_pd.py:62: end-to-end test against a real model: SGLANG_DISAGG_EXT_E2E_MODEL is not set (a local model folder, e.g. Llama-3.1-8B-Instruct)
SKIPPED [1] test/integration/test_new.py:9: a skip nobody accepted
===== 986 passed, 78 skipped, 1 xfailed, 64 warnings in 1161.46s (0:19:21) =====
--- ci-release 0.5.23: e2e ---
=================== 14 passed in 511.95s (0:08:31) ===================
--- ci-release 0.5.23: check-patches ---
"""
STAGES = """0 --- ci-release 0.5.23: test ---
1219 --- ci-release 0.5.23: e2e ---
1735 --- ci-release 0.5.23: check-patches ---
1735 --- ci-release 0.5.23: end ---
"""
SMALL_LOG = """--- ci-release 0.5.10.post1: test ---
== 105 passed, 29 skipped, 68 warnings in 260.61s (0:04:20) ==
"""
SMALL_STAGES = "0 --- ci-release 0.5.10.post1: test ---\n316 --- ci-release 0.5.10.post1: end ---\n"


@pytest.mark.timeout(30)
def test_record_rows_come_from_the_logs_oldest_release_first(tmp_path):
    rr = _script()
    for name, text in {"0.5.23.log": LOG, "0.5.23.stages": STAGES, "0.5.10.post1.log": SMALL_LOG,
                       "0.5.10.post1.stages": SMALL_STAGES, "commit": "0123456789abcdef\n"}.items():
        (tmp_path / name).write_text(text)
    text = rr.record(str(tmp_path))
    assert "commit `0123456789ab`" in text and "legs 2051 s in all" in text  # 316 + 1219 + 516 + 0
    rows = [line for line in text.splitlines() if line.startswith("| 0.5.")]
    assert rows == [
        # No SKIPPED line in that log: nothing beyond the baseline.
        "| 0.5.10.post1 | test | 316 | 105 passed, 29 skipped, 68 warnings in 260.61s | match |",
        "| 0.5.23 | test | 1219 | 986 passed, 78 skipped, 1 xfailed, 64 warnings in 1161.46s | 1 new |",
        "| 0.5.23 | e2e | 516 | 14 passed in 511.95s | 1 new |",
        "| 0.5.23 | check-patches | 0 | (no pytest summary) | 1 new |",
    ]


@pytest.mark.timeout(30)
def test_write_replaces_the_record_between_the_markers(tmp_path):
    rr = _script()
    page = tmp_path / "page.md"
    page.write_text(f"# Sweep\n\nbefore\n\n{rr.BEGIN}\nold record\n{rr.END}\n\nafter\n")
    rr.write("new record", str(page))
    assert page.read_text() == f"# Sweep\n\nbefore\n\n{rr.BEGIN}\nnew record\n{rr.END}\n\nafter\n"


@pytest.mark.timeout(30)
def test_a_folder_without_stage_files_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a CI_LOG_DIR"):
        _script().record(str(tmp_path))
