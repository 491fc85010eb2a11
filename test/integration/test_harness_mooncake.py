"""The real-engine harness, proven with SGLang's stock Mooncake backend.

Each test starts one prefill and one decode process (SGLang's real bootstrap
server, MooncakeKVManager/Sender/Receiver, a real Mooncake TransferEngine over
TCP on 127.0.0.1, CPU pools) and checks decode's byte-for-byte verification.
A run takes about 1 s once the fork server has imported SGLang (harness.procs).
"""

import importlib.util
import os

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    run_scenario,
)
from sglang_disagg_ext.selftest.harness import scenario as scenarios

pytestmark = [
    pytest.mark.engine,
    required_part("Mooncake", importlib.util.find_spec("mooncake") is not None, "mooncake transfer engine not installed"),
]

STOCK_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
# Bound for one run: startup (imports dominate) plus the requests.
RUN_TIMEOUT = 240


def _assert_ok(res):
    assert res.ok, res.describe()
    for r in res.requests:
        assert r.prefill_status == "Success" and r.decode_status == "Success", res.describe()
        assert r.bytes_verified and r.mismatches == [], res.describe()


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_kv_only_several_pages_stock_mooncake():
    scn = scenarios.kv_only("kv-only", n_pages=6)
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT)
    _assert_ok(res)
    assert res.prefill_manager == STOCK_MANAGER and res.decode_manager == STOCK_MANAGER
    assert res.backend_effective == "mooncake"
    assert res.sglang_version == releases.installed_sglang_version()
    (req,) = res.requests
    # The engine moved the pages in well under a second; the rest is process startup.
    assert req.prefill_seconds < 5 and req.decode_seconds < 5
    assert not res.killed, res.describe()


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_swa_state_equal_lengths_stock_mooncake():
    scn = scenarios.with_state("swa-equal", "swa", src_pages=[1, 2, 3], dst_pages=[7, 8, 9])
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT)
    _assert_ok(res)
    assert res.state_types == ["swa"]
    assert not any("len(prefill_state_indices)" in line for line in res.requests[0].prefill_log)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_several_requests_in_one_pair_with_chunked_sends():
    """Requests run in sequence through one process pair; KV is sent in chunks."""
    scn = Scenario(
        name="sequence",
        kv=KVPoolSpec(num_pages=24),
        state_pools=[StatePoolSpec("swa", num_pages=12, num_layers=2)],
        requests=[
            RequestSpec([1, 2, 3, 4], [10, 11, 12, 13], 0, 4, [StateSpec("swa", [1, 2], [5, 6])], send_chunks=2),
            RequestSpec([5, 6, 7], [20, 14, 15], 1, 5, [StateSpec("swa", [3], [7])], send_chunks=3),
            RequestSpec([8], [16], 2, 6, [StateSpec("swa", [], [])]),
        ],
    )
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT)
    _assert_ok(res)
    assert [r.room for r in res.requests] == [1000, 1001, 1002]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_verification_sees_one_wrong_byte():
    """The check is live: one flipped byte in one page is reported, by page."""
    scn = scenarios.kv_only("tamper", n_pages=3)
    dst = scn.requests[0].dst_kv_pages[1]
    hook = os.path.join(os.path.dirname(__file__), os.pardir, "support", "tamper.py")
    env = {"SGLANG_HARNESS_DECODE_HOOK": f"{os.path.abspath(hook)}:flip_one_byte", "SGLANG_HARNESS_TAMPER": f"kv:{dst}"}
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT, extra_env=env)
    (req,) = res.requests
    assert req.success, res.describe()
    assert not req.bytes_verified and not res.ok
    assert len(req.mismatches) == 1, req.mismatches
    assert f"kv buffer 0 page {dst}:" in req.mismatches[0]
    assert "1/256 bytes differ" in req.mismatches[0]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.skipif(
    releases.current_policy().layout is not releases.StateLayout.PER_COMPONENT,
    reason="several state components need the per-component layout (0.5.12+)",
)
def test_per_component_swa_mamba_nsa():
    scn = Scenario(
        name="hybrid",
        kv=KVPoolSpec(num_pages=12),
        state_pools=[
            StatePoolSpec("swa"),
            StatePoolSpec("mamba", num_pages=8),
            StatePoolSpec("nsa", num_layers=2, head_dim=8),
        ],
        requests=[
            RequestSpec(
                [1, 2, 3], [5, 6, 7], 0, 1,
                [StateSpec("swa", [1, 2, 3], [4, 5, 6]), StateSpec("mamba", [2], [5]), StateSpec("nsa", [3, 4], [9, 8])],
            ),
        ],
    )
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT)
    _assert_ok(res)
    assert res.state_types[:2] == ["swa", "mamba"] and res.state_types[2] in ("nsa", "dsa")


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.skipif(not releases.current_policy().is_live("F1"), reason="stock F1 bug not live in this release")
def test_stock_f1_hang_ends_within_the_bound():
    """0.5.10.post1, 5 prefill vs 3 decode SWA pages: the transfer thread dies and
    decode waits; SGLang's shortened waiting timeout ends it as Failed, and the
    harness gives up on prefill's stuck state instead of waiting the full bound."""
    scn = scenarios.with_state("f1-stock", "swa", src_pages=[1, 2, 3, 4, 5], dst_pages=[7, 8, 9])
    scn.timeouts.request_s = 40
    res = run_scenario(scn, "mooncake", timeout_s=RUN_TIMEOUT)
    (req,) = res.requests
    assert req.decode_status == "Failed", res.describe()
    assert req.prefill_status not in ("Success", "Failed"), res.describe()
    assert req.decode_seconds < scn.timeouts.sglang_waiting_s + 5
    assert any("Transfer thread failed" in t for t in req.thread_errors), res.describe()
    assert res.wall_seconds < RUN_TIMEOUT and not res.error, res.describe()
