"""Stock failure signatures: a differential accepts stock's failure only
when it is the live bug's, never a setup error, a harness error or a deadline.

Results are written by hand in the shapes real stock runs produced (0.5.10.post1,
0.5.11, 0.5.12.post1 on the Mooncake rig; 0.5.11 / 0.5.12.x retract reports), then
broken one way at a time. Nothing here runs SGLang.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import RequestResult, ScenarioResult
from sglang_disagg_ext.selftest.scenarios import mooncake

P0510 = releases.policy_for("0.5.10.post1")
P0511 = releases.policy_for("0.5.11")
P0512 = releases.policy_for("0.5.12.post1")


def _by_name(name):
    for s in mooncake.MOONCAKE_SCENARIOS + [mooncake.MOONCAKE_FAILURE_SCENARIO]:
        if s.name == name:
            return s
    raise KeyError(name)


def _thread_death(message, port=31345):
    return (
        f"prefill thread Thread-4 (transfer_worker): RuntimeError: Transfer thread failed because of "
        f"{message}. Prefill instance with bootstrap_port={port} is dead."
    )


def _waited_out(index, room, message, decode_s=8.001):
    """What stock 0.5.10.post1 yields on F1: prefill's thread dies, decode waits 8 s (the rig's
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT) and ends Failed."""
    return RequestResult(
        index,
        room,
        prefill_status="WaitingForInput",
        decode_status="Failed",
        prefill_seconds=13.06,
        decode_seconds=decode_s,
        decode_failure_reason=f"Request {room} timed out after 8.0s in KVPoll.WaitingForInput",
        thread_errors=[_thread_death(message)] if message else [],
    )


def _result(*requests, error=None, backend="mooncake"):
    return ScenarioResult("x", backend, requests=list(requests), error=error)


F1_CASES = [
    ("swa 5 vs 3 pages", "operands could not be broadcast together with shapes (4,) (2,) "),
    ("swa 3 vs 2 pages", "list index out of range"),
    ("nsa 3 vs 5 pages", "operands could not be broadcast together with shapes (2,) (4,) "),
]


@pytest.mark.parametrize("name,message", F1_CASES)
def test_f1_signature_accepts_what_stock_0510_does(name, message):
    builtin = _by_name(name)
    assert builtin.stock_signature(_result(_waited_out(0, 1000, message)), P0510) is None


@pytest.mark.parametrize("name,message", F1_CASES)
def test_f1_crashing_runs_are_not_reproductions(name, message):
    builtin = _by_name(name)
    real = _waited_out(0, 1000, message)
    cases = {
        # the harness deadline: children killed, nothing final
        "deadline": _result(
            RequestResult(0, 1000, prefill_status="WaitingForInput", decode_status="WaitingForInput"),
            error="harness deadline of 240s passed; children killed",
        ),
        # setup failure: no request reached either side
        "setup": _result(RequestResult(0, 1000), error="prefill: RuntimeError: Mooncake engine init failed"),
        # a worker crash after the request looked like the bug
        "harness error": _result(real, error="decode: no result (exit code -9)"),
        # the request raised in the worker
        "request error": _result(
            RequestResult(**{**real.__dict__, "error": "decode: KeyError: 'state0'"})
        ),
        # decode never reached a final state within the harness bound
        "decode not final": _result(RequestResult(**{**real.__dict__, "decode_status": "WaitingForInput"})),
        # another exception killed the thread
        "other exception": _result(_waited_out(0, 1000, "ZeroDivisionError: division by zero")),
        # no thread died at all
        "no thread error": _result(_waited_out(0, 1000, None)),
        # decode failed fast: something told it; not the bug, which leaves it to time out
        "decode failed fast": _result(
            RequestResult(**{**real.__dict__, "decode_seconds": 0.01, "decode_failure_reason": "Failed to get kvcache"})
        ),
        # a result with no request in it
        "no requests": _result(),
    }
    for label, result in cases.items():
        why = builtin.stock_signature(result, P0510)
        assert why, f"{label}: accepted as a reproduction"
    assert "deadline" in builtin.stock_signature(cases["deadline"], P0510)
    assert "setup failure" in builtin.stock_signature(cases["setup"], P0510)


def test_f1_is_no_reproduction_where_the_release_has_the_fix():
    builtin = _by_name("swa 5 vs 3 pages")
    result = _result(_waited_out(0, 1000, F1_CASES[0][1]))
    assert builtin.stock_signature(result, P0511)  # F1 upstream on 0.5.11


def _dsv4_request(mismatches, prefill="Success", decode="Success"):
    return RequestResult(0, 1000, prefill_status=prefill, decode_status=decode, prefill_seconds=0.005,
                         decode_seconds=0.009, mismatches=mismatches)


# What stock 0.5.10.post1 and 0.5.11 reported: decode pages 9, 10, 11 of both buffers of the
# one-layer dsv4 component hold the sentinel where prefill pages 2, 3, 4 belong.
DSV4_MISMATCHES = [
    f"state0:dsv4 buffer {b} page {d}: expected prefill page {s}'s bytes, found the sentinel (never written) "
    "(128/128 bytes differ, first at offset 0)"
    for b in (0, 1)
    for s, d in ((2, 9), (3, 10), (4, 11))
]


@pytest.mark.parametrize("policy", [P0510, P0511], ids=["0.5.10.post1", "0.5.11"])
def test_f2_signature(policy):
    builtin = _by_name("dsv4 state, 3 pages")
    assert builtin.stock_signature(_result(_dsv4_request(DSV4_MISMATCHES)), policy) is None
    not_it = {
        "one page missing": _result(_dsv4_request(DSV4_MISMATCHES[:-1])),
        "a KV page wrong too": _result(_dsv4_request(DSV4_MISMATCHES + [
            "kv buffer 0 page 5: expected prefill page 1's bytes, found the sentinel (never written) (256/256 bytes differ, first at offset 0)"
        ])),
        "state page holds other bytes": _result(_dsv4_request(
            [m.replace("found the sentinel", "found prefill page 7's bytes") for m in DSV4_MISMATCHES]
        )),
        "decode Failed": _result(_dsv4_request(DSV4_MISMATCHES, decode="Failed")),
        "harness error": _result(_dsv4_request(DSV4_MISMATCHES), error="decode: no result (exit code 1)"),
        "setup": _result(RequestResult(0, 1000), error="decode: ImportError: mooncake"),
    }
    for label, result in not_it.items():
        assert builtin.stock_signature(result, policy), f"{label}: accepted as a reproduction"


MAMBA = "Mamba should have single state index"


@pytest.mark.parametrize("policy", [P0510, P0511, P0512], ids=["0.5.10.post1", "0.5.11", "0.5.12.post1"])
def test_failure_path_signature(policy):
    """Stock on 'bad state, then good' (all three releases alike): the thread dies on the Mamba
    assertion, both requests end on decode only through the 8 s waiting timeout."""
    builtin = mooncake.MOONCAKE_FAILURE_SCENARIO
    real = _result(_waited_out(0, 1000, MAMBA), _waited_out(1, 1001, None))
    assert builtin.stock_signature(real, policy) is None
    not_it = {
        "deadline": _result(*real.requests, error="harness deadline of 240s passed; children killed"),
        "one request": _result(real.requests[0]),
        "other exception": _result(_waited_out(0, 1000, "KeyError: 3"), _waited_out(1, 1001, None)),
        "second request served": _result(
            real.requests[0], RequestResult(1, 1001, prefill_status="Success", decode_status="Success",
                                            prefill_seconds=0.1, decode_seconds=0.1, bytes_verified=True)
        ),
    }
    for label, result in not_it.items():
        assert builtin.stock_signature(result, policy), f"{label}: accepted as a reproduction"


def test_failed_then_served_needs_a_fast_failure_with_reasons():
    """Rule 5: request 0 must end Failed on both sides, with reasons, well under SGLang's 8 s timeouts."""
    assert mooncake.FAILED_WITHIN_S == 4.0  # min(8 s waiting, 8 s bootstrap) / 2
    good = RequestResult(1, 1001, prefill_status="Success", decode_status="Success", prefill_seconds=0.01,
                         decode_seconds=0.01, bytes_verified=True)
    fast = RequestResult(0, 1000, prefill_status="Failed", decode_status="Failed", prefill_seconds=0.005,
                         decode_seconds=0.009, prefill_failure_reason="state transfer failed: ...",
                         decode_failure_reason="Failed to get kvcache from prefill instance, it might be dead")
    passed = mooncake.MOONCAKE_FAILURE_SCENARIO.evaluate
    assert passed(_result(fast, good, backend="mooncake-ext"))
    # decode ended Failed only through SGLang's waiting timeout: waited out, not propagated
    slow = RequestResult(**{**fast.__dict__, "decode_seconds": 8.002,
                            "decode_failure_reason": "Request 1000 timed out after 8.0s"})
    assert not passed(_result(slow, good))
    assert not passed(_result(RequestResult(**{**fast.__dict__, "prefill_seconds": 4.5}), good))
    assert not passed(_result(RequestResult(**{**fast.__dict__, "prefill_failure_reason": None}), good))
    assert not passed(_result(RequestResult(**{**fast.__dict__, "decode_failure_reason": ""}), good))


# -- F5 -----------------------------------------------------------------------------

torch = pytest.importorskip("torch")  # f5.py builds torch pools; every venv has torch

from sglang_disagg_ext.selftest.scenarios import f5  # noqa: E402

# By hand (test_retract_f5.STOCK_SHAPE_FACTS): (nsa_pool, offloads index_k, offload takes
# mamba_indices, allocator passes mamba_indices, clear releases index_k, get_buf copies).
SHAPE_0511 = f5.StockF5Shape(True, False, False, True, False, False)
SHAPE_0512 = f5.StockF5Shape(True, True, False, True, True, True)
TYPE_ERROR = "TypeError: NSATokenToKVPool.get_cpu_copy() got an unexpected keyword argument 'mamba_indices'"


def test_f5_signature_accepts_the_live_bugs():
    lost_keys = f5.RetractReport(cycles=1000, index_k_mismatch_cycles=999)
    assert f5.stock_retract_signature(lost_keys, SHAPE_0511, "scheduler") is None
    assert f5.stock_retract_signature(lost_keys, SHAPE_0511, "pool") is None
    assert f5.stock_retract_signature(f5.RetractReport(error=TYPE_ERROR), SHAPE_0512, "scheduler") is None


def test_f5_crashing_stock_runs_are_not_reproductions():
    crashes = [
        f5.RetractReport(error="cycle 3: allocator out of pages for A"),
        f5.RetractReport(error="RuntimeError: derived parallel width 'attn_dcp_size' is not available"),
        f5.RetractReport(error="AssertionError: Torch not compiled with CUDA enabled"),
        f5.RetractReport(cycles=12, index_k_mismatch_cycles=5, error="RuntimeError: boom"),
    ]
    for report in crashes:
        assert f5.stock_retract_signature(report, SHAPE_0511, "scheduler"), report
        assert f5.stock_retract_signature(report, SHAPE_0512, "scheduler"), report
    not_it = [
        f5.RetractReport(),  # nothing ran
        f5.RetractReport(cycles=1000),  # index keys intact
        f5.RetractReport(cycles=1000, index_k_mismatch_cycles=999, kv_mismatch_cycles=3),
        f5.RetractReport(cycles=1000, index_k_mismatch_cycles=999, other_page_mismatch_cycles=1),
    ]
    for report in not_it:
        assert f5.stock_retract_signature(report, SHAPE_0511, "scheduler"), report
    # 0.5.12.x scheduler path: a TypeError about something else, or after cycles ran, is not it.
    assert f5.stock_retract_signature(f5.RetractReport(error="TypeError: unsupported operand"), SHAPE_0512, "scheduler")
    assert f5.stock_retract_signature(f5.RetractReport(cycles=1, error=TYPE_ERROR), SHAPE_0512, "scheduler")
    # 0.5.12.x through the pool works upstream: no stock failure is the bug there.
    assert f5.stock_retract_signature(f5.RetractReport(cycles=1000, index_k_mismatch_cycles=9), SHAPE_0512, "pool")
