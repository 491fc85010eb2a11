"""Rate limit for log lines that a healthy server may repeat on every request.

A state trim (F1) is expected for some models on every transfer; one WARNING per
transfer would flood a production log. :class:`EveryInterval` lets the first
event of a key through, then at most one per ``interval_s``, and tells the
caller how many it held back in between, so the line that is logged can say so.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Hashable, Optional, Tuple


class EveryInterval:
    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = float(interval_s)
        self._clock = clock
        self._mu = threading.Lock()
        # key -> (time of the last admitted event, events held back since)
        self._state: Dict[Hashable, Tuple[float, int]] = {}

    def admit(self, key: Hashable) -> Optional[int]:
        """None: hold this event back. Else the number held back for ``key`` since the last one let through."""
        now = self._clock()
        with self._mu:
            last = self._state.get(key)
            if last is None or now - last[0] >= self.interval_s:
                self._state[key] = (now, 0)
                return 0 if last is None else last[1]
            self._state[key] = (last[0], last[1] + 1)
            return None
