"""F20's lookup off the scheduler thread (``backends.common.prefill_lookup``) over a stand-in of stock's lookup.

The stand-in ``StockLookup`` is the narrowest piece of ``CommonKVManager`` the mixin touches: its
``try_ensure_parallel_info`` blocks until the test releases the address (a prefill that has not
answered yet), then fills ``prefill_info_table`` and answers True, or answers False (a failed query,
as stock's catch-all does). The real lookup against a socket that never answers, and a real
decode server beside it, are ``test/integration/test_prefill_lookup.py`` and
``test/servers/test_pd_faults.py::test_a_prefill_address_that_never_answers``.
"""

import threading
import time

import pytest

from sglang_disagg_ext.backends.common.prefill_lookup import GRACE_S, PrefillLookupOffThreadMixin

SLOW, FAST, DOWN = "10.0.0.1:8998", "10.0.0.2:8998", "10.0.0.3:8998"


class StockLookup:
    def __init__(self):
        self.prefill_info_table = {}
        self.asked = []
        self.answer = {SLOW: threading.Event()}

    def try_ensure_parallel_info(self, addr):
        self.asked.append((addr, threading.current_thread().name))
        if addr in self.answer:
            self.answer[addr].wait(30)
        if addr == DOWN:
            return False
        self.prefill_info_table[addr] = object()
        return True


class Ext(PrefillLookupOffThreadMixin, StockLookup):
    pass


def _timed(mgr, addr):
    t0 = time.monotonic()
    answer = mgr.try_ensure_parallel_info(addr)
    return answer, time.monotonic() - t0


@pytest.mark.timeout(20)
def test_an_unanswered_lookup_never_holds_the_caller():
    mgr = Ext()
    answer, held = _timed(mgr, SLOW)
    assert answer is False and held < GRACE_S + 0.5
    for _ in range(5):  # tries while it is in flight: answered at once, no second query
        answer, held = _timed(mgr, SLOW)
        assert answer is False and held < 0.05
    assert len(mgr.asked) == 1 and mgr.asked[0][1].startswith("ext-prefill-lookup")
    mgr.answer[SLOW].set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and SLOW not in mgr.prefill_info_table:
        time.sleep(0.01)
    time.sleep(0.05)  # the lookup has returned
    assert mgr.try_ensure_parallel_info(SLOW) is True  # the next try reads its answer
    assert mgr.try_ensure_parallel_info(SLOW) is True  # then the table
    assert len(mgr.asked) == 1


@pytest.mark.timeout(20)
def test_an_answering_prefill_is_served_at_the_first_try():
    mgr = Ext()
    assert mgr.try_ensure_parallel_info(FAST) is True
    assert FAST in mgr.prefill_info_table and len(mgr.asked) == 1


@pytest.mark.timeout(20)
def test_a_failed_lookup_is_a_failed_try_and_the_next_asks_again():
    mgr = Ext()
    assert mgr.try_ensure_parallel_info(DOWN) is False
    assert mgr.try_ensure_parallel_info(DOWN) is False
    assert [a for a, _ in mgr.asked] == [DOWN, DOWN]


@pytest.mark.timeout(20)
def test_one_unanswered_prefill_does_not_delay_another():
    mgr = Ext()
    assert mgr.try_ensure_parallel_info(SLOW) is False
    answer, held = _timed(mgr, FAST)
    assert answer is True and held < GRACE_S + 0.5
    mgr.answer[SLOW].set()
