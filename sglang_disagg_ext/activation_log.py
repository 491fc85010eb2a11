"""The activation line, logged where transfers happen.

``registration.activate()`` runs inside SGLang's ``load_plugins()``, which in a
scheduler process runs before SGLang configures logging: a line logged then is
lost. So ``activate()`` only records the line here, and each ``-ext`` manager
logs it once per process from its constructor (the scheduler thread, logging
configured), at INFO: SGLang's default ``--log-level info`` shows it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

logger = logging.getLogger("sglang_disagg_ext")

_mu = threading.Lock()
_line: Optional[str] = None
_backend: Optional[str] = None
_announced = False


def record(line: Optional[str], backend: Optional[str] = None) -> None:
    """What ``activate()`` installed in this process (None: nothing), for ``backend`` (the -ext name)."""
    global _line, _backend, _announced
    with _mu:
        _line, _backend, _announced = line, backend, False


def announce(manager) -> bool:
    """Log the recorded line once per process (``manager``: the ``-ext`` KV manager just built);
    True if this call logged it. Also fixes the process's SGLang labels for every series (from
    ``manager``), sets the info metric and this role's transfer series at zero."""
    global _announced
    from sglang_disagg_ext import __version__

    with _mu:
        if _announced or _line is None:
            return False
        _announced = True
        line = _line
    logger.info("sglang-disagg-ext %s active in this process (pid %d, %s): %s", __version__, os.getpid(),
                type(manager).__name__, line)
    from sglang_disagg_ext import metrics, releases

    policy = releases.current_policy()
    metrics.set_process_labels(releases.sglang_metric_labels(manager))
    metrics.set_info(__version__, _backend, policy.version, policy.active_fixes())
    mode = getattr(getattr(manager, "disaggregation_mode", None), "value", None)
    if _backend and mode in ("prefill", "decode"):
        metrics.zero_transfer_series(_backend, mode)
    return True
