"""``python -m bench.run --quick``: the whole benchmark at tiny sizes, end to end.

Real SGLang managers, real Mooncake over TCP on loopback, real NIXL descriptor
lists, real plugin loading in fresh interpreters (see ``bench/*``). Checks the
shape of ``results.json`` and that every ratio is a positive finite number;
no figure is compared with a target here (performance is not a test verdict).
The growth PNG is checked where matplotlib is installed (``make bench``
installs ``requirements/bench.txt``; a plain test venv may not have it, and
then the run is told not to plot).
"""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from bench import results as res
from bench.run import NO_GPU
from sglang_disagg_ext import releases

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 540


# Items 1, 2, 6, 7 compare the -ext Mooncake manager with stock: the bench runs where
# mooncake-ext has a live fix (0.5.10.post1-0.5.23) and refuses where it is a pass-through.
# Items 3 and 4 (F4, F5 code) say "n/a: upstream on this release" where those are upstream.
POLICY = releases.current_policy()
ACTIVE = any(POLICY.is_live(f) for f in ("F1", "F2", "F6", "F7", "F8", "F9")) and POLICY.routes("mooncake")


@pytest.mark.timeout(300)
@pytest.mark.skipif(ACTIVE, reason="the refusal is for pass-through releases; this release runs the bench")
def test_bench_refuses_on_a_pass_through_release(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "nothing to compare" in proc.stderr and "pass-through" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.skipif(not ACTIVE, reason="F1-F5 upstream here: the bench refuses (test above)")
def test_bench_quick_run_writes_valid_results(tmp_path):
    out = tmp_path / "results.json"
    png = tmp_path / "growth.png"
    plot = importlib.util.find_spec("matplotlib") is not None
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--quiet", "--out", str(out), "--png", str(png) if plot else "",
           "--max-seconds", str(RUN_TIMEOUT_S)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group only
        proc.communicate()
        pytest.fail(f"bench.run --quick did not finish within {RUN_TIMEOUT_S} s")
    assert proc.returncode == 0, log[-4000:]

    data = json.loads(out.read_text())
    res.validate(data)  # the required keys, each ratio list non-empty with exactly case + ratio
    res.check_samples(data)  # every ratio and CPU figure recomputes from the samples it lists
    for key in res.RATIO_KEYS:
        if data[key] == res.NA_UPSTREAM:
            fix = "F4" if key == "slice_build_over_stock" else "F5"
            assert not POLICY.is_live(fix), (key, fix)
            continue
        for row in data[key]:
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0, (key, row)
    # Added CPU per request for every transfer case, with the 8K-token case the target is judged at;
    # stock and ext handed the engine the same descriptor lists in every traced sample.
    assert {r["case"] for r in data["ext_cpu_overhead"]} == {r["case"] for r in data["ext_over_stock"]}
    assert any(r["tokens"] == res.CPU_TARGET_TOKENS for r in data["details"]["transfer"])
    for r in data["details"]["transfer"]:
        assert r["cpu"]["engine_calls_identical"], (r["case"], r["cpu"]["engine_calls"])
        assert r["cpu"]["engine_calls"]["stock"]["descriptors"] > 0
        assert all(v == 0 for v in r["cpu"]["stock_plugin_us"])  # no plugin frame on the stock manager
        assert all(v > 0 for v in r["cpu"]["added_us"]), r["case"]
    fixes = {row["fix"] for row in data["fix_cpu_overhead"]}
    for fix in ("F6", "F7"):  # the newest release's fixes each get a cost row where live
        assert (fix in fixes) == POLICY.is_live(fix), (fix, fixes)
    if POLICY.is_live("F6"):
        assert all(r["cpu"]["decode_bounds_known"] for r in data["details"]["transfer"])  # F6 really checked
    assert math.isfinite(data["plugin_load_ms"])
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert len(data["load_average_start"]) == 3 and len(data["load_average_end"]) == 3
    # Every transfer case checked its bytes in the warm-up batch (decode compared every page).
    assert all(r["verified"] for r in data["details"]["transfer"])
    assert {r["case"] for r in data["details"]["transfer"]} == {r["case"] for r in data["ext_over_stock"]}
    assert "1 ext/stock" in log and "5 plugin load" in log and "6 added CPU" in log  # the table was printed
    # Item 8: verified/unverified at 8K tokens where verification works here (hand list: Mooncake on
    # every release of CI's, test_doctor.VERIFY_AVAILABLE), else n/a.
    if POLICY.version in ("0.5.10.post1", "0.5.11", "0.5.12.post1", "0.5.23"):
        assert {r["case"] for r in data[res.VERIFY_KEY]} == {"kv 8K tok x1", "kv+state 8K tok x1"}, data[res.VERIFY_KEY]
        assert "8 verified" in log
        # The read floor ran in the same rounds (a round whose decode did not read its pages fails the run).
        assert all(len(r["samples_s"]["read"]) == r["repeats"] for r in data["details"]["verified"])
        assert "8 read floor" in log
    else:
        assert data[res.VERIFY_KEY].startswith("n/a: "), data[res.VERIFY_KEY]
    if data["gpu"] == NO_GPU:
        assert NO_GPU in log
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
