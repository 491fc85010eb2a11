"""F23 on real NIXL (UCX over 127.0.0.1): a request opens a room decode already ended.

Two requests, one at a time, prefill TP 1 -> decode TP 1. Request 0: decode's receiver is made and
bootstrapped (``init``: prefill's rank endpoints known), then aborted before its metadata (a
pre-allocation that waited for KV memory, then the client's abort): SGLang fails the room on decode
and sends its ABORT to prefill, for a room no request has opened there yet. Prefill opens the room
only after its bootstrap thread has handled that ABORT (the harness notes each ABORT the manager's
``_handle_abort_notification`` takes; ``RequestSpec.decode_ends_first``). Request 1 is served as usual
after it.

Stock (0.5.16-0.5.23: the handler ignores a room it has no status for, ``room_active`` False, 0.5.16
nixl/conn.py:2360-2377, 0.5.23 :3317-3335): the request that opens the room waits for metadata no
decode will send, pinning its KV on prefill: on 0.5.16/0.5.17 (no bootstrap deadline in NIXL's
sender) still Bootstrapping at the harness bound; from 0.5.18 Failed at SGLang's bootstrap timeout
(``BOOTSTRAP_S``). Run by hand on 0.5.16, 0.5.18 and 0.5.23.
``nixl-ext``: Failed as it opens the room, with a reason naming the room; nothing written to decode's
pages for it (all hold the harness's sentinel); request 1 byte-verified; no thread died;
``requests_refused_total{fix="F23"}`` is 1 on prefill.

The one replacement, as in every NIXL test here: both sides register host memory through the
harness's shim (``harness/nixl_shim.py``; UCX here has no CUDA support).
"""

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, Scenario, Timeouts
from support import ended_first

POLICY = releases.current_policy()
pytestmark = [
    pytest.mark.engine,
    # Before 0.5.16 NIXL prefill's loop has no ABORT handler (F13/F15 own what an ABORT does there).
    pytest.mark.skipif(not POLICY.is_live("F23"), reason=f"F23 is not covered on SGLang {POLICY.version} (0.5.16+)"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]
BOOTSTRAP_S = 6.0  # prefill's bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)
WAITING_S = 120.0  # decode's waiting timeout: far past the bound, as SGLang's default 300 s is
REQUEST_S = 10.0  # the harness bound per request and side
REFUSED_WITHIN_S = 3.0
RUN_BOUND_S = 240
ROOM_BASE = 2300
SHIM = {nixl_shim.ENV: "1"}


def _scenario() -> Scenario:
    return Scenario(
        name="decode ended the room before prefill opened it (NIXL)",
        requests=ended_first.requests(),
        kv=KVPoolSpec(num_pages=14),
        room_base=ROOM_BASE,
        timeouts=Timeouts(request_s=REQUEST_S, sglang_waiting_s=WAITING_S, sglang_bootstrap_s=BOOTSTRAP_S),
    )


@pytest.mark.timeout(RUN_BOUND_S)
def test_stock_prefill_waits_for_a_room_decode_ended():
    stock = run_scenario(_scenario(), "nixl", extra_env=SHIM)
    assert not stock.error, stock.describe()
    ended, after = stock.requests
    assert after.ok, stock.describe()
    assert ended.decode_status == "Failed", stock.describe()
    # Stock's ABORT handler ignored the room (no status yet): the request that opened it waited for
    # decode's metadata, to the bootstrap timeout where NIXL's sender has one, else past the bound.
    if releases.features().stock_nixl_sender_bootstrap_deadline:
        assert ended.prefill_status == "Failed", stock.describe()
        assert "timed out" in (ended.prefill_failure_reason or ""), stock.describe()
        assert ended.prefill_seconds is not None and ended.prefill_seconds >= BOOTSTRAP_S - 0.5, stock.describe()
    else:
        assert ended.prefill_status == "Bootstrapping", stock.describe()
        assert ended.prefill_seconds is not None and ended.prefill_seconds >= REQUEST_S - 0.5, stock.describe()
    print(f"stock: prefill held room {ended.room}, which decode had ended, for {ended.prefill_seconds} s "
          f"({ended.prefill_status}: {ended.prefill_failure_reason})")


@pytest.mark.timeout(RUN_BOUND_S)
def test_ext_prefill_fails_a_room_decode_ended_when_it_opens_it():
    ext = run_scenario(_scenario(), "nixl-ext", extra_env=SHIM)
    assert ext.prefill_manager.startswith("sglang_disagg_ext."), ext.describe()
    ended_first.assert_ext_fails_it_on_opening(ext, "F23", REFUSED_WITHIN_S)
