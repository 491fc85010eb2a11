"""F14's decode-side refusal (``backends.common.prefill_pairing``) over a stand-in of stock's lookup.

The stand-in ``StockLookup`` is the narrowest piece of ``CommonKVManager`` the mixin touches: its
``try_ensure_parallel_info`` raises as 0.5.23's does for a page-size mismatch (the message copied
from ``common/conn.py:1321``), and the room bookkeeping (``addr_to_rooms_tracker``,
``record_failure``, ``update_status``, ``check_status``) behaves as stock's. Stock's behaviour with
real servers (the decode process exits) and ``-ext``'s (it keeps serving) are shown by
``test/servers/test_pd_faults.py::test_a_prefill_with_another_page_size_joins_the_pool``.
"""

from collections import defaultdict

import pytest

from sglang_disagg_ext.backends.common import prefill_pairing
from sglang_disagg_ext.backends.common.prefill_pairing import PrefillPairingMixin

BAD, GOOD = "10.0.0.1:8998", "10.0.0.2:8998"
FAILED, BOOTSTRAPPING = 0, 1
MISMATCH = ("Page size mismatch: prefill server has page_size=32, but decode server has page_size=16. "
            "Both servers must use the same --page-size value.")


class StockLookup:
    def __init__(self):
        self.addr_to_rooms_tracker = defaultdict(set)
        self.request_status, self.failure_records = {}, {}
        self.asked = []
        self.prefill_info_table = {}

    def try_ensure_parallel_info(self, addr):
        self.asked.append(addr)
        if addr == BAD:
            raise RuntimeError(MISMATCH)
        self.prefill_info_table[addr] = object()
        return True

    def record_failure(self, room, reason):
        self.failure_records[room] = reason

    def update_status(self, room, status):
        self.request_status[room] = status

    def check_status(self, room):
        return self.request_status[room]

    def wait(self, addr, room):
        self.addr_to_rooms_tracker[addr].add(room)
        self.request_status[room] = BOOTSTRAPPING


class Ext(PrefillPairingMixin, StockLookup):
    def _ext_tell_prefill(self, addr, rooms):
        # The notice to prefill (backends.common.prefill_notice, tested in test_prefill_notice.py
        # against a real bootstrap server and socket): recorded here, not sent.
        self.__dict__.setdefault("told", []).append((addr, list(rooms)))


@pytest.mark.timeout(10)
def test_stock_raises_on_a_prefill_it_cannot_pair_with():
    with pytest.raises(RuntimeError, match="Page size mismatch"):
        StockLookup().try_ensure_parallel_info(BAD)


@pytest.mark.timeout(10)
def test_ext_refuses_that_prefill_and_fails_its_rooms_with_the_reason(caplog):
    mgr = Ext()
    mgr.wait(BAD, 1)
    mgr.wait(BAD, 2)
    mgr.wait(GOOD, 3)
    assert mgr.try_ensure_parallel_info(BAD) is False
    assert mgr.request_status == {1: FAILED, 2: FAILED, 3: BOOTSTRAPPING}
    reason = f"prefill {BAD} cannot pair with this decode, its requests are refused: RuntimeError: {MISMATCH}"
    assert mgr.failure_records == {1: reason, 2: reason}
    # Every other prefill is served as before.
    assert mgr.try_ensure_parallel_info(GOOD) is True
    # A later request to the refused prefill fails at once, without asking it again.
    mgr.wait(BAD, 4)
    assert mgr.try_ensure_parallel_info(BAD) is False
    assert mgr.request_status[4] == FAILED and mgr.failure_records[4] == reason
    assert mgr.asked == [BAD, GOOD]
    # Prefill is told of each room decode failed, once: rooms 1 and 2 at the refusal, room 4 later.
    assert mgr.told == [(BAD, [1, 2]), (BAD, [4])]
    errors = [r for r in caplog.records if "cannot pair" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelname == "ERROR"


@pytest.mark.timeout(10)
def test_a_refusal_is_asked_again_after_its_recheck_time(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(prefill_pairing.time, "monotonic", lambda: now[0])
    mgr = Ext()
    mgr.wait(BAD, 1)
    assert mgr.try_ensure_parallel_info(BAD) is False
    now[0] += prefill_pairing.RECHECK_S - 1
    mgr.try_ensure_parallel_info(BAD)
    assert mgr.asked == [BAD]
    now[0] += 2
    mgr.try_ensure_parallel_info(BAD)
    assert mgr.asked == [BAD, BAD]


@pytest.mark.timeout(10)
def test_a_room_already_concluded_is_left_alone():
    mgr = Ext()
    mgr.wait(BAD, 1)
    mgr.update_status(1, FAILED)
    mgr.record_failure(1, "its own reason")
    mgr.addr_to_rooms_tracker[BAD].add(2)  # cleared by stock meanwhile: no status any more
    assert mgr.try_ensure_parallel_info(BAD) is False
    assert mgr.failure_records == {1: "its own reason"}
    assert 2 not in mgr.request_status
