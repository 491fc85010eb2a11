"""The harness's multi-rank runs (P prefill ranks x D decode ranks) on the installed release.

One process per rank, real gloo groups built the way the release's scheduler
builds them (``harness/sglang_setup.py::init_runtime``: up to 0.5.12 the
``parallel_state`` initialisers with explicit sizes; 0.5.13+ ``runtime_context.publish``
with a ``SpawnRanks`` placement first, then groups whose widths come from the
published context), SGLang's real bootstrap server, managers, senders and
receivers, a real Mooncake TransferEngine (or NIXL agent) over TCP on
127.0.0.1, CPU pools. Each rank's KV pool, and each paged state pool, holds
its share of the model's heads (``patterns.rank_kv_heads``); decode ranks check
every element of the heads they hold and that every other page still holds
the sentinel.

Nothing is replaced in the code under test. The one injection is the
harness's decode hook (``test/support/tamper.py``: one byte of one decode page
flipped after the transfer, before verification), to show the per-head check
of a state pool sees it.
"""

import dataclasses
import importlib.util
import os

import pytest
from conftest import require_or_skip, required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim, patterns
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)

pytestmark = [
    pytest.mark.engine,
    required_part("Mooncake", importlib.util.find_spec("mooncake") is not None, "mooncake transfer engine not installed"),
]

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")
# Runs that end on checks: SGLang's own bounds are never waited out when the room is served,
# so they are long (a CI run loaded by other tests once took a TP 2 -> 1 room 13.9 s on
# 0.5.12.post1, past the 10 s these were); request_s leaves room for three engine processes
# on two cores.
TIMEOUTS = Timeouts(request_s=60.0, startup_s=150.0, sglang_waiting_s=30.0, sglang_bootstrap_s=30.0)
# The stock SWA runs on the older releases end only through the waiting
# timeout, twice; 5 s there still leaves a served request (0.5.23) seconds.
STOCK_SWA_TIMEOUTS = dataclasses.replace(TIMEOUTS, sglang_waiting_s=5.0, sglang_bootstrap_s=10.0)
RUN_BOUND_S = 360  # one run's pytest bound: startup, the requests, teardown
HEAD_DIM = 8  # bf16: 16 bytes per head per token


def _names(p: int, d: int):
    return [f"prefill{r}" for r in range(p)] + [f"decode{r}" for r in range(d)]


def _sglang_ranks(p: int, d: int):
    """What SGLang must have computed in each worker: rank r of a side is attention
    TP rank r of a group as wide as that side, and world rank r of its own gloo world."""
    out = {}
    for side, size in (("prefill", p), ("decode", d)):
        for r in range(size):
            out[f"{side}{r}"] = {"attn_tp_rank": r, "attn_tp_size": size, "world_rank": r, "world_size": size}
    return out


def kv_scenario(p: int, d: int) -> Scenario:
    """2 KV heads: with TP 2 each rank holds one, so decode bytes come from the right rank's head."""
    return Scenario(
        name=f"ranks kv tp{p}->tp{d}",
        requests=[RequestSpec([1, 2, 3], [5, 6, 7], aux_index=1, dst_aux_index=2)],
        kv=KVPoolSpec(num_pages=9, head_num=2, head_dim=HEAD_DIM),
        prefill_tp=p,
        decode_tp=d,
        timeouts=TIMEOUTS,
    )


def swa_scenario(p: int, d: int, timeouts: Timeouts = TIMEOUTS) -> Scenario:
    """KV pages 1,2 -> 3,4 and SWA pages 1,2,3 -> 4,5,6; then KV 5 -> 6, SWA 7 -> 9.

    The SWA pool has as many KV heads as the full-attention layers (2), as in
    SGLang's hybrid SWA models, and is sharded over the ranks the same way.
    """
    return Scenario(
        name=f"ranks swa tp{p}->tp{d}",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=0, dst_aux_index=1, state=[StateSpec("swa", [1, 2, 3], [4, 5, 6])]),
            RequestSpec([5], [6], aux_index=1, dst_aux_index=2, state=[StateSpec("swa", [7], [9])]),
        ],
        kv=KVPoolSpec(num_pages=8, head_num=2, head_dim=HEAD_DIM),
        state_pools=[StatePoolSpec(kind="swa", num_pages=12, head_num=2, head_dim=HEAD_DIM)],
        prefill_tp=p,
        decode_tp=d,
        timeouts=timeouts,
    )


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)], ids=["tp2-tp1", "tp1-tp2"])
def test_p_by_d_ranks_move_every_kv_element(p, d):
    """Stock Mooncake, P x D rank processes: SGLang computed each worker's rank from its own
    parallel state, and every decode rank holds exactly the heads its rank must hold."""
    res = run_scenario(kv_scenario(p, d), "mooncake")
    assert res.ok, res.describe()
    assert res.sglang_version == releases.installed_sglang_version()
    (req,) = res.requests
    assert req.rank_status == {n: "Success" for n in _names(p, d)}, res.describe()
    assert req.mismatches == [], res.describe()
    assert res.sglang_ranks == _sglang_ranks(p, d), res.sglang_ranks


@pytest.mark.timeout(RUN_BOUND_S)
def test_swa_state_heads_over_ranks_are_checked_per_element(tmp_path):
    """Prefill TP 2 -> decode TP 2 with an SWA pool (equal TP: every release sends it).

    Each decode rank flips byte 0 of its SWA page 5 (buffer 0 = K of layer 0)
    after the transfer. Decode rank r holds global SWA head r (2 heads over
    TP 2), so the only mismatch each rank may report is token 0, head r, dim 0
    of page 5, which must hold prefill page 2's element there; every other
    element of both pools and every untouched page checks out.
    """
    env = {
        "SGLANG_HARNESS_DECODE_HOOK": os.path.join(SUPPORT, "tamper.py") + ":flip_one_byte",
        "SGLANG_HARNESS_TAMPER": "state0:swa:5",
    }
    res = run_scenario(swa_scenario(2, 2), "mooncake", extra_env=env)
    assert res.sglang_ranks == _sglang_ranks(2, 2), res.sglang_ranks
    first, second = res.requests
    assert first.rank_status == {n: "Success" for n in _names(2, 2)}, res.describe()
    assert second.ok, res.describe()
    # The expected element, by hand: prefill page 2 of SWA buffer 0 holds the
    # model's page pattern (pool id 2 = first state pool) restricted to the rank's head.
    head_bytes = HEAD_DIM * 2
    expected = []
    for rank in range(2):
        page = patterns.page_bytes(2, 0, 2, 4 * 2 * head_bytes).reshape(4, 2, head_bytes)
        cell = page[0, rank, 0:2].copy()
        tampered = cell.copy()
        tampered[0] ^= 0xFF
        expected.append(
            f"decode{rank}: decode rank {rank} state0:swa buffer 0 (K layer 0) page 5 token 0 head {rank} dim 0: "
            f"expected prefill page 2's element 0x{cell.tobytes().hex()}, found 0x{tampered.tobytes().hex()}"
        )
    assert first.mismatches == expected, res.describe()


NIXL_IMPORTABLE = engine_importable("nixl")


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_stock_swa_state_from_prefill_tp2_to_decode_tp1(backend):
    """Stock, prefill TP 2 -> decode TP 1, SWA pool sharded like the KV heads.

    Where the release's stock manager has SWA head slices
    (``releases.features().stock_swa_head_slice_backends``: 0.5.23 both
    backends, mooncake/conn.py:2435, nixl/conn.py:2969), every element lands on
    the decode rank and prefill logs which path it took. Elsewhere both prefill
    ranks raise "PD Disaggregation does NOT support PD different TP sizes for
    non-MLA SWA hybrid models yet." per request (0.5.10.post1 mooncake/conn.py:1003,
    nixl/conn.py:703; 0.5.11 :1004, :868; 0.5.12.post1 :1052, :1547) and decode
    is never told: it ends Failed only through SGLang's waiting timeout (5 s
    here, ``STOCK_SWA_TIMEOUTS``). Where it is raised differs: Mooncake's transfer thread dies (prefill
    rooms never end); NIXL 0.5.12.x fails the room in its transfer worker;
    NIXL 0.5.10.post1/0.5.11 raise out of ``sender.send()`` itself, the
    scheduler's own call. NIXL stock runs get the harness's host-memory shim
    (``harness/nixl_shim.py``), as every stock NIXL run on CPU pools does.
    """
    if backend == "nixl":
        require_or_skip("NIXL", NIXL_IMPORTABLE, "nixl._api does not import")
    env = {nixl_shim.ENV: "1"} if backend == "nixl" else None
    res = run_scenario(swa_scenario(2, 1, STOCK_SWA_TIMEOUTS), backend, extra_env=env)
    assert res.prefill_manager == f"sglang.srt.disaggregation.{backend}.conn.{backend.capitalize()}KVManager"
    assert res.sglang_ranks == _sglang_ranks(2, 1), res.sglang_ranks
    if backend in releases.features().stock_swa_head_slice_backends:
        assert res.ok, res.describe()
        line = "Using SWA state head-slice transfer for different attention TP sizes: prefill=2, decode=1."
        assert any(line in x for x in res.requests[0].prefill_log), res.describe()
        return
    refusal = "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid models yet."
    for r in res.requests:
        assert r.decode_status == "Failed" and "timed out" in (r.decode_failure_reason or ""), res.describe()
        assert r.decode_seconds >= STOCK_SWA_TIMEOUTS.sglang_waiting_s - 0.5, res.describe()
    first = res.requests[0]
    if backend == "mooncake":  # the transfer thread dies on both prefill ranks; their rooms never end
        assert first.prefill_status == "WaitingForInput", res.describe()
        assert sum(refusal in t for t in first.thread_errors) == 2, res.describe()
        return
    for rank in ("prefill0", "prefill1"):
        reason = f"{rank}: {refusal}"
        raised = f"{rank}: Traceback"  # send() raised it: the rank's request has an error, no status
        if first.rank_status[rank] == "Failed":  # 0.5.12.x: the transfer worker failed the room
            assert reason in (first.prefill_failure_reason or ""), res.describe()
        else:
            assert first.rank_status[rank] is None, res.describe()
            error = (first.error or "").split(raised, 1)[1].split("\nprefill", 1)[0]
            assert error.rstrip().endswith(f"RuntimeError: {refusal}"), res.describe()
