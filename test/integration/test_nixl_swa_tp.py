"""F13 on real NIXL (UCX over 127.0.0.1), 0.5.13-0.5.21: SWA state across attention TP sizes, stock ``nixl`` vs ``nixl-ext``.

One process per rank, prefill TP 2 -> decode TP 1, 1 -> 2 and 1 -> 4, a model with 2 KV
heads whose SWA window cache is sharded like its KV (``scenarios.nixl.swa_tp_scenario``: KV
pages 1-3 -> 5-7, SWA state pages 2, 3 -> 8, 9, aux row 1 -> 2). Decode ranks check every
element of the heads they hold on every destination page, KV and SWA alike, against the
placement the harness derives from the sharding rule (``harness/patterns.py``), and that every
other page still holds its sentinel.

Stock raises "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid
models yet." on each prefill rank, per request (0.5.13 nixl/conn.py:1616-1618 ... 0.5.21
:2674-2676); decode is told from 0.5.20 (``conclude_failure``), before that it ends the room
only by SGLang's waiting timeout. ``nixl-ext`` (``backends/nixl_swa_tp.py``) sends the window
cache as head slices. The one replacement: both sides register host memory through the
harness's shim (``harness/nixl_shim.py``), since UCX here has no CUDA support and stock
registers the pools as "VRAM"; ``nixl-ext`` keeps stock's memory handling, so it gets the same
shim. Nothing in the code under test is replaced.
"""

import functools

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios import nixl as S

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not releases.current_policy().is_live("F13"), reason="F13 is not live on this release"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]

EXT_MANAGER = "sglang_disagg_ext.backends.nixl_swa_tp.NixlSwaTpKVManager"
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
REFUSAL = "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid models yet."
RUN_BOUND_S = 240  # one run: startup, one request (stock: up to SGLang's waiting timeout), teardown


@functools.lru_cache(maxsize=None)
def run(p: int, d: int, backend: str):
    result = run_scenario(S.swa_tp_scenario(p, d), backend, extra_env={nixl_shim.ENV: "1"})
    assert result.prefill_manager == (EXT_MANAGER if backend == "nixl-ext" else STOCK_MANAGER), result.describe()
    assert result.decode_manager == result.prefill_manager, result.describe()
    return result


def ranks(p: int, d: int):
    return [f"prefill{r}" for r in range(p)] + [f"decode{r}" for r in range(d)]


def per_rank(names, text: str) -> str:
    """How the harness joins one reason reported by several ranks."""
    return "; ".join(f"{n}: {text}" for n in names) if len(names) > 1 else f"{names[0]}: {text}"


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", S.F13_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in S.F13_TOPOLOGIES])
def test_stock_refuses_swa_state_across_tp_sizes(p, d):
    """Stock: every prefill rank fails the request with the refusal; decode is told (0.5.20+) or
    waits out SGLang's waiting timeout; the SWA state pages keep their sentinel."""
    result = run(p, d, "nixl")
    (r,) = result.requests
    assert r.rank_status == {n: "Failed" for n in ranks(p, d)}, result.describe()
    assert r.prefill_failure_reason == per_rank([f"prefill{k}" for k in range(p)], REFUSAL), result.describe()
    decode_ranks = [f"decode{k}" for k in range(d)]
    timeouts = S.swa_tp_scenario(p, d).timeouts
    if releases.features().stock_nixl_worker_tells_decode:
        assert r.decode_failure_reason == per_rank(decode_ranks, REFUSAL), result.describe()
        assert r.decode_seconds < timeouts.sglang_waiting_s, result.describe()
    else:
        for name in decode_ranks:
            assert f"{name}: " in r.decode_failure_reason and "timed out" in r.decode_failure_reason, result.describe()
        assert r.decode_seconds >= timeouts.sglang_waiting_s - 0.5, result.describe()
    state = [m for m in r.mismatches if "state0:swa" in m and "more mismatching" not in m]
    assert state and all("found the sentinel" in m for m in state), result.describe()
    assert not any("must be untouched" in m for m in r.mismatches), result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", S.F13_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in S.F13_TOPOLOGIES])
def test_ext_sends_swa_state_as_head_slices(p, d):
    """-ext: Success on every rank, every element of every KV and SWA head on every destination
    page as placed by the sharding rule, every other page its sentinel, no thread error."""
    result = run(p, d, "nixl-ext")
    (r,) = result.requests
    assert result.ok, result.describe()
    assert r.rank_status == {n: "Success" for n in ranks(p, d)}, result.describe()
    assert r.bytes_verified and r.mismatches == [], result.describe()
    assert r.thread_errors == [], result.describe()
