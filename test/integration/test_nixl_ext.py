"""F4 on real NIXL (UCX over 127.0.0.1), CPU pools, one process per rank.

Every scenario runs through the transfer harness: prefill and decode ranks are
separate processes with real gloo groups, SGLang's real bootstrap server,
managers, senders and receivers. Decode ranks check every element of the KV
heads they hold (K/V, layer, page, token, head, dim) against what the model's
head placement says they must hold, and that every other page still holds the
sentinel.

Differential: every stock run is held to the expectation its scenario states
(``scenarios_nixl``: F4 live per ``releases.py``, refined by probes of the
installed stock source). Stock <= 0.5.11 keys KV notifications on the pipeline
rank, so prefill TP 2 -> decode TP 1 never completes; 0.5.12.x keys them on the
TP rank (that part is fixed) but, like 0.5.11, maps decode-side head replicas
by modulo, so 2 KV heads over prefill TP 1 -> decode TP 4 end Success with the
wrong head on decode ranks 1 and 2; 0.5.10.post1 divides by zero there. Ext
passes everything. Stock heterogeneous-TP runs get the
harness's host-memory shim (``harness/nixl_shim.py``), otherwise stock fails
at registration on a CPU-only UCX before reaching the code under test; the
host-memory scenario runs stock without it.
"""

import functools
import re
import warnings

import numpy as np
import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.harness.run import RequestResult, ScenarioResult, run_scenario
from sglang_disagg_ext.selftest.scenarios.nixl import TIMEOUTS, by_name, stock_slice_uses_total_heads

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not (releases.current_policy().is_live("F4") or "F4" in releases.current_policy().patched),
        reason="F4's classes are not nixl-ext's here (F4 upstream: F13's class on 0.5.13-0.5.21, F11's on 0.5.22/0.5.23)",
    ),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]

POLICY = releases.current_policy()
EXT_MANAGER = "sglang_disagg_ext.backends.nixl.conn.NixlExtKVManager"
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"


def run_uncached(name: str, which: str):
    """One harness run of a built-in scenario, stock or ext."""
    builtin = by_name(name)
    if which == "stock":
        return run_scenario(builtin.build(), "nixl", extra_env=builtin.stock_env())
    return run_scenario(
        builtin.build(), "nixl-ext", extra_env=builtin.ext_env(), decode_backend=builtin.decode_backend_for_ext
    )


# One harness run per (scenario, stock|ext) per session, shared by the tests that read it.
run = functools.lru_cache(maxsize=None)(run_uncached)


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
    # Every rank's agent was made with the paced progress thread (harness/nixl_pacing.py).
    assert {name: e.get("progress_thread_delay_us") for name, e in result.engines.items()} == {
        name: 100 for name in result.requests[0].rank_status
    }, result.engines


@pytest.mark.timeout(420)
def test_stock_tp2_to_tp1_completes_only_with_per_rank_keys():
    """One replicated KV head over prefill TP 2 -> decode TP 1, stock vs ext.

    Stock expectation from the scenario: "fail" where stock tags KV
    notifications with the pipeline rank (0.5.10.post1 nixl/conn.py:751,
    0.5.11 :923: both prefill ranks send the same key), "pass" where it uses
    the TP rank (0.5.12.post1 :661-662).
    """
    builtin = by_name("kv tp2->tp1 h1")
    stock = run(builtin.name, "stock")
    ext = run(builtin.name, "ext")
    assert stock.prefill_manager == STOCK_MANAGER, stock.describe()
    assert_ext_ok(ext)
    if builtin.stock_expectation(POLICY) == "pass":
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
    if not stock_slice_uses_total_heads():
        # Stock's per-rank head math treats half a head as a head: the second
        # rank overwrites the upper dims of every token's head.
        assert kv_mismatches, stock.describe()
    else:
        assert not kv_mismatches, stock.describe()


# decode1: decode rank 1 kv buffer 0 (K layer 0) page 5 token 0 head 0 dim 0: expected prefill
# page 1's element 0xc8d4, found 0xed60
_ELEMENT = re.compile(
    r"^decode(\d+): decode rank \d+ kv buffer (\d+) \([KV] layer \d+\) page \d+ token (\d+) head (\d+) "
    r"dim (\d+): expected prefill page (\d+)'s element 0x[0-9a-f]+, found (0x[0-9a-f]+|the sentinel)$"
)


def _element_of_head(scn, buffer: int, src_page: int, token: int, head: int, dim: int) -> str:
    """The bytes prefill page ``src_page`` holds for (token, head, dim), as the mismatch lines print them."""
    assert scn.kv.dtype == "bfloat16", scn.kv.dtype
    head_bytes = scn.kv.head_dim * 2
    page = patterns.kv_rank_pages(buffer, [src_page], scn.page_size, scn.kv.head_num, head_bytes, [head])
    cell = page.reshape(scn.page_size, head_bytes)[token, dim * 2 : dim * 2 + 2]
    return "0x" + np.ascontiguousarray(cell).tobytes().hex()


def _nixl_failed_before_any_transfer(result) -> bool:
    """Prefill never left Bootstrapping because NIXL itself failed in its bootstrap thread."""
    r = result.requests[0] if result.requests else None
    return (
        r is not None
        and r.rank_status.get("prefill0") == "Bootstrapping"
        and any("bootstrap_thread" in t and "NIXL_ERR_BACKEND" in t for t in r.thread_errors)
    )


def _starved_without_error(result) -> bool:
    """A rank ran out of time with no error anywhere: five engine processes on two cores, not the code under test.

    Seen in CI: a decode rank got no notification in 45 s while the prefill sat
    in WaitingForInput (patched 0.5.11), and two decode ranks frozen for
    12-15 s (0.5.12.post1). The head-slice bugs under test never end this way:
    stock 0.5.11 / 0.5.12.x write the wrong head and report Success, and
    0.5.10.post1 raises ZeroDivisionError (an error, so no re-run).
    """
    r = result.requests[0] if result.requests else None
    if r is None or result.error or r.error or r.thread_errors:
        return False
    statuses = list(r.rank_status.values())
    timed_out = "timed out" in (r.decode_failure_reason or "")
    return any(s != "Success" for s in statuses) and (timed_out or any(s not in ("Success", "Failed") for s in statuses))


def _p1d4_result(rank_status, decode_reason=None, error=None):
    req = RequestResult(0, 1000, decode_failure_reason=decode_reason, error=error, rank_status=rank_status)
    return ScenarioResult("tp1->tp4 2 kv heads", "nixl", requests=[req])


@pytest.mark.timeout(10)
def test_only_errorless_timeouts_count_as_starved():
    """The re-run rule, on the shapes seen in CI and the shapes of the bugs under test (hand-written results)."""
    ok = "Success"
    timed_out = "decode1: Request 1000 timed out after 45.0s in KVPoll.WaitingForInput"
    # Patched 0.5.11 in CI: prefill still WaitingForInput, decode rank 1 timed out.
    assert _starved_without_error(
        _p1d4_result({"prefill0": "WaitingForInput", "decode0": ok, "decode1": "Failed", "decode2": ok, "decode3": ok}, timed_out)
    )
    # 0.5.12.post1 in CI: prefill Success late, decode ranks 0 and 2 timed out.
    assert _starved_without_error(
        _p1d4_result({"prefill0": ok, "decode0": "Failed", "decode1": ok, "decode2": "Failed", "decode3": ok}, timed_out)
    )
    # Stock 0.5.11 / 0.5.12.x: wrong head everywhere it matters, but Success on every rank.
    assert not _starved_without_error(_p1d4_result({r: ok for r in ("prefill0", "decode0", "decode1", "decode2", "decode3")}))
    # Stock 0.5.10.post1: ZeroDivisionError on prefill, every decode rank times out.
    assert not _starved_without_error(
        _p1d4_result(
            {"prefill0": "Transferring", "decode0": "Failed", "decode1": "Failed", "decode2": "Failed", "decode3": "Failed"},
            timed_out,
            error="ZeroDivisionError: integer division or modulo by zero",
        )
    )


# Runs after the first when a P1->D4 *stock* leg failed for the environment. Uncached:
# the session-4 version re-read the lru_cache and so never ran again (CI, d633822).
# An -ext run is never run again: its first result is the result (a second try would hide an -ext failure that happens one run in a few).
P1D4_ENV_RERUNS = 2


def run_five_ranks(name: str, which: str, runner=run_uncached, reruns: int = P1D4_ENV_RERUNS):
    """One P1->D4 run. ``which == "ext"``: exactly one run, whatever it gives.

    Stock: run again (fresh processes) while it failed for the environment, at
    most ``reruns`` times; every discarded run is recorded on the returned
    result (``result.discarded_runs``, shown by :func:`describe`) and in the
    warnings summary, so a reader sees that the stock result is not a first run.
    """
    result = runner(name, which)
    discarded = []
    if which == "stock":
        for attempt in range(1, reruns + 1):
            if not (_nixl_failed_before_any_transfer(result) or _starved_without_error(result)):
                break
            note = f"P1->D4 stock: run {attempt} failed for the environment and was run again:\n{result.describe()[:3000]}"
            warnings.warn(note)
            discarded.append(note)
            result = runner(name, which)
    result.discarded_runs = discarded
    return result


def describe(result) -> str:
    """``result.describe()``, headed by the runs the rig discarded before it, if any."""
    discarded = getattr(result, "discarded_runs", None) or []
    head = [f"NOTE: this is run {len(discarded) + 1}; {len(discarded)} earlier run(s) discarded as starved:"]
    return "\n".join((head + discarded if discarded else []) + [result.describe()])


@pytest.mark.timeout(10)
def test_environment_failures_run_again_in_fresh_processes():
    """The re-run calls the runner again (no cached result) and stops at the first run that did not starve."""
    ok = "Success"
    ranks = ("prefill0", "decode0", "decode1", "decode2", "decode3")
    starved = _p1d4_result(
        {"prefill0": "Bootstrapping", "decode0": "Failed", "decode1": "Failed", "decode2": "Failed", "decode3": "Failed"},
        "decode2: Request 1000 timed out after 45.0s in KVPoll.WaitingForInput",
    )
    finished = _p1d4_result({r: ok for r in ranks})
    script = [starved, starved, finished]
    calls = []

    def runner(name, which):
        calls.append((name, which))
        return script[len(calls) - 1]

    with pytest.warns(UserWarning, match="failed for the environment"):
        assert run_five_ranks("kv tp1->tp4 h2", "stock", runner=runner) is finished
    assert calls == [("kv tp1->tp4 h2", "stock")] * 3
    # The result says it is the third run, and why the first two were discarded.
    assert len(finished.discarded_runs) == 2
    assert describe(finished).startswith("NOTE: this is run 3; 2 earlier run(s) discarded as starved:")
    # Out of re-runs: the last starved result is what the test sees and reports.
    calls.clear()
    script = [starved, starved, starved, finished]
    with pytest.warns(UserWarning):
        assert run_five_ranks("kv tp1->tp4 h2", "stock", runner=runner) is starved
    assert len(calls) == 3
    # A bug signature (Success everywhere, or an error) is never run again.
    calls.clear()
    script = [finished, starved]
    assert run_five_ranks("kv tp1->tp4 h2", "stock", runner=runner) is finished
    assert len(calls) == 1
    assert finished.discarded_runs == [] and not describe(finished).startswith("NOTE")


@pytest.mark.timeout(10)
def test_ext_runs_are_never_run_again():
    """An -ext run that starved, or failed before any transfer, is the result: no second try."""
    ranks = ("prefill0", "decode0", "decode1", "decode2", "decode3")
    starved = _p1d4_result(
        {"prefill0": "Bootstrapping", "decode0": "Failed", "decode1": "Failed", "decode2": "Failed", "decode3": "Failed"},
        "decode2: Request 1000 timed out after 45.0s in KVPoll.WaitingForInput",
    )
    finished = _p1d4_result({r: "Success" for r in ranks})
    assert _starved_without_error(starved)
    calls = []

    def runner(name, which):
        calls.append((name, which))
        return [starved, finished][len(calls) - 1]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running it again" warning either
        assert run_five_ranks("kv tp1->tp4 h2", "ext", runner=runner) is starved
    assert calls == [("kv tp1->tp4 h2", "ext")]
    assert starved.discarded_runs == []


@pytest.mark.timeout(900)
def test_gqa_replicas_over_decode_tp4_land_on_the_ranks_that_hold_them():
    """2 KV heads, prefill TP 1 -> decode TP 4 (5 processes), stock vs ext.

    Head placement (SGLang's QKV sharding): prefill rank 0 holds heads 0 and 1;
    with H = 2 < D = 4 each head is on D/H = 2 consecutive decode ranks, decode
    rank d holds head d // 2. Stock 0.5.11 / 0.5.12.x pick the source head as
    ``(d * heads_per_decode_rank) % heads_per_prefill_rank = d % 2``
    (0.5.11 nixl/conn.py:554-556, 0.5.12.post1 :1002-1004):

        decode rank | must hold head | stock writes head
        0           | 0              | 0
        1           | 0              | 1   wrong, reported Success
        2           | 1              | 0   wrong, reported Success
        3           | 1              | 1

    0.5.10.post1 computes heads per decode rank as ``kv_head_num * P // D =
    2 * 1 // 4 = 0`` (conn.py:484) and divides by it (:489): ZeroDivisionError
    on prefill, every decode rank times out. Ext writes each decode rank the
    head it holds; the harness checks every element on every decode rank.
    """
    builtin = by_name("kv tp1->tp4 h2")
    ext = run_five_ranks(builtin.name, "ext")  # one run, never repeated
    assert_ext_ok(ext)
    assert len(ext.requests[0].rank_status) == 5

    stock = run_five_ranks(builtin.name, "stock")
    if "F4" in POLICY.patched:
        # Sources carrying patches/<release>/: stock has the replica map fixed.
        assert builtin.stock_expectation(POLICY) == "pass"
        assert stock.ok, describe(stock)
        return
    assert builtin.stock_expectation(POLICY) == "fail"  # F4 live on every active release
    assert stock.prefill_manager == STOCK_MANAGER, describe(stock)
    assert not stock.ok, describe(stock)
    r = stock.requests[0]
    if not stock_slice_uses_total_heads():
        assert "ZeroDivisionError" in (r.error or stock.error or ""), describe(stock)
        assert r.decode_status == "Failed" and "timed out" in (r.decode_failure_reason or ""), describe(stock)
        return
    # Success everywhere: nothing tells the operator that two ranks hold the wrong head.
    assert all(s == "Success" for s in r.rank_status.values()), describe(stock)
    scn = builtin.build()
    wrong = {}
    for line in r.mismatches:
        if line.endswith("mismatching elements not listed"):
            continue
        m = _ELEMENT.match(line)
        assert m, f"unexpected mismatch line: {line}"
        rank, buffer, token, head, dim, src_page, found = m.groups()
        wrong.setdefault(int(rank), set()).add(int(head))
        other = 1 - int(head)
        # What the rank holds instead is, element for element, the other head.
        assert found == _element_of_head(scn, int(buffer), int(src_page), int(token), other, int(dim)), line
    assert wrong == {1: {0}, 2: {1}}, describe(stock)


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


SWA_TOPOLOGIES = [(2, 1), (1, 2), (1, 4)]
# Stock NIXL's refusal, by hand from the wheels (0.5.11 nixl/conn.py:866-869).
STOCK_SWA_TP_REFUSAL = "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid models yet"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("p,d", SWA_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in SWA_TOPOLOGIES])
def test_swa_state_across_tp_sizes_every_element(p, d):
    """KV and an SWA window cache (2 KV heads each; state pages 2, 3 -> 8, 9) from prefill TP
    P to decode TP D. Stock NIXL raises for non-MLA SWA state whenever the TP sizes differ
    (0.5.10.post1 nixl/conn.py:701-704, 0.5.11 :866-869, 0.5.12.post1 :1545-1548): the
    request ends Failed (0.5.12.x) or decode waits out its waiting timeout. ``nixl-ext``
    sends the window cache as head slices with F4's layout, and every decode rank checks
    every element of the heads it holds, of KV and of the window cache, and that every
    other page still holds the sentinel. Stock runs at 2 -> 1 and 1 -> 2 only: its refusal
    tests the two TP sizes alone, the same line for every shape, and a stock 1 -> 4 run
    only waits out the five-rank waiting timeout (30 s) to show it again."""
    builtin = by_name(f"kv+swa tp{p}->tp{d} h2")
    scn = builtin.build()
    assert scn.state_pools and scn.requests[0].state[0].src_pages == [2, 3]
    ext = run(builtin.name, "ext")
    assert_ext_ok(ext)
    if d == 4:
        return
    stock = run(builtin.name, "stock")
    assert builtin.stock_expectation(POLICY) == "fail"
    # Stock's own refusal, on every prefill rank's request: not any request failing for any reason.
    assert stock.requests and not any(r.ok for r in stock.requests), stock.describe()
    assert STOCK_SWA_TP_REFUSAL in stock.describe(logs=True), stock.describe(logs=True)
