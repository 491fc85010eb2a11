"""``selftest --protocol/--device/--ib-device`` reach the workers, and options this
machine cannot honour end with a clear error, on the real Mooncake engine.

This machine has no GPU and no RDMA device. What that allows, and is done:

* ``--device cuda`` is refused before any transfer (exit 2, the reason named);
* ``--protocol rdma`` goes all the way to the real engine start in both worker
  processes and fails there, bounded, with "RDMA init failed" and the IB
  device tried (measured: Mooncake 0.3.13.post1 itself falls back to TCP and
  returns 0, so the harness checks the engine's topology);
* the default run's workers report the protocol the engine was really
  initialised with and the device of every pool they built, and an explicit
  ``--protocol tcp --device cpu`` selftest row passes as the default does.

GPU pools and a working RDMA transfer are not exercised here (no GPU or HCA
is lent to these runners); ``docs/selftest-on-a-node.md`` says how to run them
on a node. Nothing is faked.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import required_part

from sglang_disagg_ext import releases, verification
from sglang_disagg_ext.selftest.harness import run_scenario
from sglang_disagg_ext.selftest.harness import scenario as scenarios

HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None
needs_mooncake = required_part("Mooncake", HAS_MOONCAKE, "the mooncake transfer engine is not installed")
RUN_TIMEOUT = 240  # one harness run: two workers' imports dominate on 2 shared cores
CLI_TIMEOUT = 2 * RUN_TIMEOUT + 60  # stock + ext of one scenario, plus the CLI's own imports


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _rdma_devices():
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _cli(*args, timeout):
    """Run the CLI in a child process; ``subprocess.run`` kills it if the bound passes.

    Each scenario run gets ``RUN_TIMEOUT``, not the CLI's 60 s default (an operator's bound):
    under CI's load (four test processes on two cores, each run's two workers importing
    SGLang) an -ext row whose whole CLI run takes ~43 s alone ran past 60 s and counted as
    failed."""
    return subprocess.run(
        [sys.executable, "-m", "sglang_disagg_ext.cli", "selftest", "--timeout", str(RUN_TIMEOUT), *args],
        capture_output=True, text=True, timeout=timeout,
    )


def _first_mooncake_scenario() -> str:
    from sglang_disagg_ext.selftest.scenarios.mooncake import scenarios_for

    return scenarios_for(releases.current_policy())[0].name


# -- refused before any transfer ----------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.skipif(_has_cuda(), reason="this machine has CUDA: --device cuda would be honoured, not refused")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_without_cuda_exits_before_any_transfer(device):
    out = _cli("--backend", "mooncake", "--device", device, timeout=240)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"--device {device}: CUDA is not available here" in out.stderr
    assert "torch.cuda.is_available() is False" in out.stderr
    assert out.stdout == ""  # no table: nothing ran


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "gpu"], "--device 'gpu': expected cpu, cuda or cuda:N"),
        (["--ib-device", "mlx5_0"], "--ib-device 'mlx5_0' names an RDMA device; it applies only with --protocol rdma"),
        (["--scenario", "no such row"], "--scenario 'no such row': no such scenario"),
    ],
)
def test_bad_options_named(args, message):
    out = _cli("--backend", "mooncake", *args, timeout=240)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert out.stdout == ""


# -- RDMA on a machine without RDMA ------------------------------------------------------


@pytest.mark.engine
@pytest.mark.timeout(CLI_TIMEOUT + 30)
@needs_mooncake
@pytest.mark.skipif(bool(_rdma_devices()), reason=f"this machine has RDMA devices {_rdma_devices()}: RDMA would start")
def test_protocol_rdma_fails_definitely_in_both_workers():
    name = _first_mooncake_scenario()
    out = _cli("--backend", "mooncake", "--protocol", "rdma", "--scenario", name, "--json", timeout=CLI_TIMEOUT)
    assert out.returncode == 1, (out.stdout[-3000:], out.stderr[-3000:])
    rows = json.loads(out.stdout)["rows"]
    assert [r["scenario"] for r in rows] == [name]  # --scenario: F5 rows not run
    (row,) = rows
    assert row["ext"] == "fail" and row["stock"] == "fail" and row["verified"] is False
    detail = row["ext_detail"]
    # Both workers reached the engine start and reported the same failure.
    for role in ("prefill", "decode"):
        assert f"{role}: RuntimeError: RDMA init failed: Mooncake TransferEngine: no RDMA device found" in detail, detail
    assert detail.count("(ib device tried: none given (auto-discovery))") == 2, detail
    assert "Mooncake installed its TCP transport instead" in detail
    assert "harness deadline" not in detail  # ended by the failure, not by the bound
    assert row["engine_transport"] == [] and row["pool_devices"] == []  # no worker got past the engine


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT + 30)
@needs_mooncake
@pytest.mark.skipif("mlx5_0" in _rdma_devices(), reason="this machine has mlx5_0: the device would be accepted")
def test_named_ib_device_that_is_absent_fails_naming_it():
    res = run_scenario(
        scenarios.kv_only("rdma-mlx5_0", n_pages=2), "mooncake", timeout_s=RUN_TIMEOUT,
        protocol="rdma", ib_device="mlx5_0",
    )
    assert not res.ok and res.setup_failed, res.describe()
    assert res.transfer == {"protocol": "rdma", "device": "cpu", "ib_device": "mlx5_0"}
    for role in ("prefill", "decode"):
        assert f"{role}: RuntimeError: RDMA init failed: ServerArgs:" in res.error, res.describe()
    assert res.error.count("(ib device tried: mlx5_0)") == 2, res.error
    assert "harness deadline" not in res.error
    assert res.exit_codes == {"prefill": 0, "decode": 0}, res.describe()


# -- the default path, and the same options spelled out ----------------------------------------


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT + 30)
@needs_mooncake
def test_default_run_reports_tcp_engine_and_cpu_pools(policy):
    scn = scenarios.with_state("swa-on-cpu", "swa", src_pages=[1, 2], dst_pages=[9, 10])
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT)
    assert res.ok, res.describe()
    assert res.transfer == {"protocol": "tcp", "device": "cpu", "ib_device": None}
    # SGLang up to 0.5.12 hard-codes "rdma" in its engine wrapper and the
    # harness's MC_FORCE_TCP=1 makes Mooncake use TCP; 0.5.13+ pass
    # MOONCAKE_PROTOCOL ("tcp") through.
    # (Read in the wrappers of 0.5.10.post1, 0.5.11, 0.5.12.post1 and 0.5.23.)
    hard_coded_rdma = tuple(int(x) for x in policy.version.split(".")[:3]) < (0, 5, 13)
    for role in ("prefill", "decode"):
        engine = res.engines[role]
        assert engine["engine"] == "mooncake"
        assert engine["initialize_protocol"] == ("rdma" if hard_coded_rdma else "tcp")
        assert engine["mc_force_tcp"] is True
        assert engine["transport"] == "tcp"
        assert res.pool_devices[role] == {"kv": "cpu", "aux": "cpu", "state0:swa": "cpu"}


@needs_mooncake
@pytest.mark.engine
@pytest.mark.timeout(CLI_TIMEOUT + 30)
def test_explicit_options_ext_only_and_verify_in_one_row():
    """One CLI row with the options composed, each checked on what it changes (one run for the
    three: CI time). ``--protocol tcp --device cpu``: the row passes like the default, engines on
    TCP, pools on the CPU. ``--ext-only``: the row's -ext run passes with its bytes verified;
    stock is "not run", never a verdict, and the JSON says which mode ran. ``--verify``: the
    -ext workers run with ``SGLANG_DISAGG_EXT_VERIFY=1``; where verified transfers exist
    (``verification.available``; by hand: Mooncake on every release of the matrix,
    ``test_doctor.VERIFY_AVAILABLE``) the row's decode checked the room against prefill's digest
    and its plugin metrics say so; elsewhere the run says the rows are unverified."""
    name = _first_mooncake_scenario()
    out = _cli("--backend", "mooncake", "--protocol", "tcp", "--device", "cpu", "--scenario", name,
               "--ext-only", "--verify", "--json", timeout=CLI_TIMEOUT)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    report = json.loads(out.stdout)
    (row,) = [r for r in report["rows"] if r["scenario"] == name]
    # --protocol tcp --device cpu
    assert row["ext"] == "pass" and row["verified"] is True, row
    assert row["engine_transport"] == ["tcp"] and row["pool_devices"] == ["cpu"], row
    # --ext-only
    assert report["ext_only"] is True
    assert row["stock"] == "not run" and row["stock_detail"] == "not run (--ext-only)"
    assert "each row runs -ext only (--ext-only)" in out.stderr
    # --verify
    assert report["verify"] is True
    if not verification.available(releases.current_policy())["mooncake-ext"]:
        assert row["digests"].get("ok", 0) >= 1 and not row["digests"].get("mismatch"), row
    else:
        assert "digests" not in row, row
        assert "--verify: mooncake-ext rows run unverified" in out.stderr, out.stderr[-2000:]
