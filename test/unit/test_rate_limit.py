"""EveryInterval: first event through, then one per interval, with the count held back."""

import pytest

from sglang_disagg_ext.core.rate_limit import EveryInterval


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.mark.timeout(10)
def test_one_per_interval_per_key_with_the_count_held_back():
    clock = Clock()
    limit = EveryInterval(60.0, clock=clock)
    assert limit.admit("swa") == 0  # first: through, nothing held back
    assert limit.admit("nsa") == 0  # keys are independent
    for _ in range(5):
        clock.t += 10.0  # t = 110 .. 150
        assert limit.admit("swa") is None
    clock.t = 159.9
    assert limit.admit("swa") is None  # 6 held back now
    clock.t = 160.0  # exactly one interval after the last admitted event
    assert limit.admit("swa") == 6
    assert limit.admit("swa") is None
    clock.t = 400.0
    assert limit.admit("swa") == 1
    assert limit.admit("nsa") == 0


@pytest.mark.timeout(10)
def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        EveryInterval(0)
