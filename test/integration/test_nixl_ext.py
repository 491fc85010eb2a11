"""F4 on real NIXL (UCX over 127.0.0.1), CPU pools, one process per rank.

Every scenario runs through the transfer harness: prefill and decode ranks are
separate processes with real gloo groups, SGLang's real bootstrap server,
managers, senders and receivers. Decode ranks check every element of the KV
heads they hold (K/V, layer, page, token, head, dim) against what the model's
head placement says they must hold, and that every other page still holds the
sentinel.

Differential: where ``releases.py`` says F4 is live (0.5.10.post1, 0.5.11)
stock must fail the prefill TP 2 -> decode TP 1 scenario (decode never
completes; on 0.5.10.post1 with one replicated head the bytes are wrong too)
and ext must pass; on 0.5.12.x both pass. Stock heterogeneous-TP runs get the
harness's host-memory shim (``harness/nixl_shim.py``), otherwise stock fails
at registration on a CPU-only UCX before reaching the code under test; the
host-memory scenario runs stock without it.
"""

import functools

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.harness.run import run_scenario
from sglang_disagg_ext.scenarios_nixl import TIMEOUTS, by_name

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        releases.current_policy().support is not releases.Support.ACTIVE,
        reason="nixl-ext routes to the stock classes on this release (pass-through)",
    ),
    pytest.mark.skipif(not engine_importable("nixl"), reason="NIXL is not installed"),
]

POLICY = releases.current_policy()
EXT_MANAGER = "sglang_disagg_ext.backends.nixl.NixlExtKVManager"
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"


@functools.lru_cache(maxsize=None)
def run(name: str, which: str):
    """One harness run per (scenario, stock|ext) per session."""
    builtin = by_name(name)
    if which == "stock":
        return run_scenario(builtin.build(), "nixl", extra_env=builtin.stock_env())
    return run_scenario(
        builtin.build(), "nixl-ext", extra_env=builtin.ext_env(), decode_backend=builtin.decode_backend_for_ext
    )


def assert_ext_ok(result):
    assert result.prefill_manager == EXT_MANAGER, result.describe()
    assert result.ok, result.describe()
    for r in result.requests:
        assert not r.timed_out, result.describe()
        assert all(s == "Success" for s in r.rank_status.values()), r.rank_status


TOPOLOGIES = [(2, 1, 1), (2, 1, 2), (2, 1, 4), (1, 2, 1), (1, 2, 2), (1, 2, 4)]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("p,d,h", TOPOLOGIES, ids=[f"tp{p}-tp{d}-h{h}" for p, d, h in TOPOLOGIES])
def test_ext_heterogeneous_tp_every_element(p, d, h):
    result = run(f"kv tp{p}->tp{d} h{h}", "ext")
    assert_ext_ok(result)
    assert len(result.requests[0].rank_status) == p + d


@pytest.mark.timeout(420)
def test_stock_tp2_to_tp1_does_not_complete_where_f4_is_live():
    """One replicated KV head over prefill TP 2 -> decode TP 1, stock vs ext."""
    name = "kv tp2->tp1 h1"
    stock = run(name, "stock")
    ext = run(name, "ext")
    assert stock.prefill_manager == STOCK_MANAGER, stock.describe()
    assert_ext_ok(ext)
    if not POLICY.is_live("F4"):
        assert stock.ok, stock.describe()
        return
    assert not stock.ok, stock.describe()
    r = stock.requests[0]
    # Both prefill ranks finish their writes; decode waits for a second key
    # that never comes, until SGLang's (here shortened) waiting timeout.
    assert r.prefill_status == "Success", stock.describe()
    assert r.decode_status == "Failed", stock.describe()
    assert r.decode_seconds >= TIMEOUTS.sglang_waiting_s - 0.5, stock.describe()
    assert "timed out" in (r.decode_failure_reason or ""), stock.describe()
    kv_mismatches = [m for m in r.mismatches if " kv buffer " in m]
    if POLICY.version == "0.5.10.post1":
        # Stock's per-rank head math treats half a head as a head: the second
        # rank overwrites the upper dims of every token's head.
        assert kv_mismatches, stock.describe()
    else:
        assert not kv_mismatches, stock.describe()


@pytest.mark.timeout(420)
def test_stock_decode_completes_on_ext_prefill_keys():
    result = run("ext prefill, stock decode, tp2->tp1 h2", "ext")
    assert result.decode_manager == STOCK_MANAGER, result.describe()
    assert_ext_ok(result)


@pytest.mark.timeout(420)
def test_swa_state_from_host_memory_and_index_mismatch():
    builtin = by_name("swa state from host memory")
    stock = run(builtin.name, "stock")
    ext = run(builtin.name, "ext")
    # Stock registers the host-memory pools as VRAM; UCX without CUDA refuses.
    assert not stock.requests or not any(r.success for r in stock.requests), stock.describe()
    assert "NIXL" in (stock.error or ""), stock.describe()
    assert ext.prefill_manager == EXT_MANAGER, ext.describe()
    assert builtin.passed(ext), ext.describe()
    mismatch = ext.requests[1]
    assert "State index length mismatch" in (mismatch.prefill_failure_reason or ""), ext.describe()
    assert "State index length mismatch" in (mismatch.decode_failure_reason or ""), ext.describe()


@pytest.mark.timeout(420)
def test_impossible_head_layout_refused_with_numbers():
    builtin = by_name("3 kv heads over decode tp 2")
    result = run(builtin.name, "ext")
    assert builtin.passed(result), result.describe()
    assert "decode TP size 2 does not divide the 3 KV heads" in result.requests[0].prefill_failure_reason
