"""Every request's transfer counted and timed, whatever the engine: ``transfers_total`` and
``transfer_duration_seconds`` (``metrics``).

``registration.activate`` routes each engine's sender and receiver through :func:`counted`, a
subclass of the class SGLang would otherwise build there (the plugin's own where it has one,
else SGLang's). SGLang builds one sender per request on prefill and one receiver per request on
decode, and polls it until it says Success or Failed; the first such answer counts once, with the
seconds since the object was built. Nothing else changes: every call goes to the class below.
"""

from __future__ import annotations

import functools
import time

from sglang_disagg_ext import metrics

# KVPoll's definite states (the same values in every release: Failed = 0, Success = 4).
_OUTCOMES = {0: "failed", 4: "success"}


def counted(cls: type, backend: str, role: str) -> type:
    """A subclass of SGLang's sender or receiver class ``cls`` that counts its request's outcome.

    ``backend`` is the ``-ext`` name, ``role`` ``prefill`` (a sender) or ``decode`` (a receiver).
    """

    class Counted(cls):
        # wraps: the signature stays stock's (callers read it to choose their arguments).
        @functools.wraps(cls.__init__)
        def __init__(self, *args, **kwargs):
            """Contract: SGLang builds one per request, on the scheduler thread, when the request
            enters the bootstrap queue (prefill) or the pre-allocation queue (decode)."""
            self._ext_started = time.monotonic()
            self._ext_counted = False
            super().__init__(*args, **kwargs)

        @functools.wraps(cls.poll)
        def poll(self):
            """Contract: SGLang's scheduler thread polls every live request's sender or receiver
            each step until it answers Success or Failed; it must return what stock returns."""
            status = super().poll()
            if not self._ext_counted:
                outcome = _OUTCOMES.get(int(status)) if status is not None else None
                if outcome is not None:
                    self._ext_counted = True
                    metrics.transfer_done(backend, role, outcome, time.monotonic() - self._ext_started)
            return status

    Counted.__name__ = Counted.__qualname__ = cls.__name__
    Counted.__module__ = cls.__module__
    Counted.__doc__ = cls.__doc__
    return Counted
