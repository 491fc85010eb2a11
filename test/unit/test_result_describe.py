"""``ScenarioResult.describe`` on a failed multi-rank request: per-rank phase times.

The times are wall-clock seconds from several processes; the report shows them
against the earliest one, so a rank that sent late stands out. Expected lines
are written out by hand.
"""

import pytest

from sglang_disagg_ext.selftest.harness.run import RequestResult, ScenarioResult

pytestmark = pytest.mark.timeout(30)


def _result(ok: bool) -> ScenarioResult:
    status = "Success" if ok else "Failed"
    req = RequestResult(index=0, room=1000, prefill_status="Success" if ok else "Bootstrapping", decode_status=status)
    req.bytes_verified = ok
    req.rank_phases = {
        "prefill0": {"barrier": 1000.0, "bootstrapped": 1011.25},
        "decode0": {"barrier": 1000.5, "send": 1000.75},
        "decode1": {"barrier": 1000.5, "send": 1006.0},
    }
    return ScenarioResult(scenario="tp1->tp2", backend="nixl", requests=[req])


def test_failed_request_lists_each_rank_against_the_earliest_time():
    text = _result(ok=False).describe(logs=False)
    assert "    prefill0 at: barrier=+0.00s bootstrapped=+11.25s" in text.splitlines()
    assert "    decode0 at: barrier=+0.50s send=+0.75s" in text.splitlines()
    assert "    decode1 at: barrier=+0.50s send=+6.00s" in text.splitlines()


def test_successful_request_omits_the_phase_lines():
    assert " at: " not in _result(ok=True).describe(logs=False)
