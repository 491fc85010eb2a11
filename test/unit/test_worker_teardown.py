"""A harness worker stays up until every rank of the run is done, and no longer than its bound.

Why: stock decode can reach Success on the first prefill rank's aux notification
(NIXL ``received_aux`` is one bool) while another prefill rank is still posting
its last transfer. A decode process that exits at that point destroys its NIXL
agent under that transfer, and the prefill rank fails with
NIXL_ERR_REMOTE_DISCONNECT (seen once in CI, P2->D1 on 0.5.12.post1).

The worker here is the real ``sglang_disagg_ext.selftest.harness.worker`` process. Its
scenario file does not exist, so its setup fails before SGLang is imported;
the teardown path that follows is the one every run takes.
"""

import os
import subprocess
import sys
import time

import pytest

# With no scenario loaded the worker's wait for the other ranks is bounded by 5 s.
NO_SCENARIO_BOUND_S = 5.0


@pytest.fixture
def worker(tmp_path):
    """Start the real worker as a decode rank whose peers are ``others``; stopped by its PID afterwards."""
    procs = []

    def start(own, others):
        cmd = [
            sys.executable, "-m", "sglang_disagg_ext.selftest.harness.worker",
            "--role", "decode",
            "--scenario", str(tmp_path / "missing-scenario.json"),
            "--backend", "nixl",
            "--bootstrap-port", "1",
            "--model-dir", str(tmp_path),
            "--dist-init", "file://" + str(tmp_path / "dist"),
            "--result", str(tmp_path / "decode.json"),
            "--done-file", str(own),
            "--done-files", os.pathsep.join(str(p) for p in [own, *others]),
            "--max-seconds", "60",
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        assert wait_for(own.exists, 30), "the worker never marked itself done"
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def wait_for(predicate, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.timeout(60)
def test_worker_exits_only_after_every_rank_is_done(tmp_path, worker):
    own, other = tmp_path / "decode.done", tmp_path / "prefill.done"
    proc = worker(own, [other])
    time.sleep(1.0)
    assert proc.poll() is None, "the worker left while another rank was still running"
    other.write_text("1")
    proc.wait(timeout=3)
    assert proc.returncode == 0


@pytest.mark.timeout(60)
def test_worker_leaves_after_its_bound_when_a_rank_never_finishes(tmp_path, worker):
    own, other = tmp_path / "decode.done", tmp_path / "prefill.done"
    proc = worker(own, [other])
    marked = time.monotonic()
    proc.wait(timeout=NO_SCENARIO_BOUND_S + 10)
    assert time.monotonic() - marked >= NO_SCENARIO_BOUND_S - 1.0
    assert not other.exists()


@pytest.mark.timeout(30)
def test_done_file_carries_the_counts_other_ranks_wait_for(tmp_path):
    """A decode rank's done file holds the mismatch notices it sent per prefill address
    (prefill waits until it has counted them); a done file without counts reads as none."""
    from sglang_disagg_ext.selftest.harness import worker as w

    done = tmp_path / "decode.done"
    w._touch(str(done), {"127.0.0.1:5000": 2.0})
    assert w._done_file_counts(str(done)) == {"127.0.0.1:5000": 2.0}
    assert not list(tmp_path.glob("*.tmp"))  # written whole, renamed into place
    plain = tmp_path / "old.done"
    plain.write_text("1234")
    assert w._done_file_counts(str(plain)) == {}
    assert w._done_file_counts(str(tmp_path / "missing.done")) == {}
