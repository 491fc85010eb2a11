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
(``BOOTSTRAP_S``; scenario and verdicts: ``test/support/orphan_rooms.py``). Run by hand on 0.5.16, 0.5.18 and 0.5.23.
``nixl-ext``: Failed as it opens the room, with a reason naming the room; nothing written to decode's
pages for it (all hold the harness's sentinel); request 1 byte-verified; no thread died;
``requests_refused_total{fix="F23"}`` is 1 on prefill.

The one replacement: both sides register host memory through the harness's shim (``orphan_rooms.run``).
"""

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from support import orphan_rooms as O

POLICY = releases.current_policy()
pytestmark = [
    pytest.mark.engine,
    # Before 0.5.16 NIXL prefill's loop has no ABORT handler (F13/F15 own what an ABORT does there).
    pytest.mark.skipif(not POLICY.is_live("F23"), reason=f"F23 is not covered on SGLang {POLICY.version} (0.5.16+)"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]
ROOM_BASE = 2300


@pytest.mark.timeout(O.RUN_BOUND_S)
def test_stock_prefill_waits_for_a_room_decode_ended():
    stock = O.run(O.ended_first_scenario(ROOM_BASE), "nixl")
    O.assert_stock_waits_for_the_room_decode_ended(
        stock, sender_deadline=releases.features().stock_nixl_sender_bootstrap_deadline)


@pytest.mark.timeout(O.RUN_BOUND_S)
def test_ext_prefill_fails_a_room_decode_ended_when_it_opens_it():
    ext = O.run(O.ended_first_scenario(ROOM_BASE), "nixl-ext")
    assert ext.prefill_manager.startswith("sglang_disagg_ext."), ext.describe()
    O.assert_ext_fails_it_on_opening(ext, "F23")
