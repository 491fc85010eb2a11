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


# The bench measures F1-F5 code: it runs where F5 is live and refuses elsewhere.
ACTIVE = releases.current_policy().is_live("F5")


@pytest.mark.timeout(120)
@pytest.mark.skipif(ACTIVE, reason="the refusal is for releases with F1-F5 upstream; this release runs the bench")
def test_bench_refuses_on_a_pass_through_release(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "nothing to compare" in proc.stderr and "F1-F5 upstream" in proc.stderr, proc.stderr[-2000:]
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
    for key in res.RATIO_KEYS:
        for row in data[key]:
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0, (key, row)
    assert math.isfinite(data["plugin_load_ms"])
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert len(data["load_average_start"]) == 3 and len(data["load_average_end"]) == 3
    # Every transfer case checked its bytes in the warm-up batch (decode compared every page).
    assert all(r["verified"] for r in data["details"]["transfer"])
    assert {r["case"] for r in data["details"]["transfer"]} == {r["case"] for r in data["ext_over_stock"]}
    assert "1 ext/stock" in log and "5 plugin load" in log  # the table was printed
    if data["gpu"] == NO_GPU:
        assert NO_GPU in log
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
