"""Pace NIXL's progress thread in harness workers, so five NIXL processes fit on two cores.

NIXL's Python API (nixl-cu12 1.5.1, ``nixl_agent.__init__``) sets
``nixlAgentConfig.pthrDelay = 0``. With that value the agent's progress thread
runs ``ucp_worker_progress`` in a loop and never sleeps. Each NIXL process then
uses a whole core even when it is idle. Measured here: one idle agent with a UCX
backend used 4.99 s of CPU in 5.0 s. The P1->D4 scenario runs five such
processes on a two-core CI machine. Whole processes froze there for 10-15 s, and
the prefill's bootstrap HTTP server missed SGLang's 5 s read timeout ("Could not
fetch bootstrap info").

The delay only spaces out progress calls. The engine, the UCX transports, the
registrations and every byte moved stay the same; a completion or notification
is seen at most ``delay_us`` later. With 100 us, the same idle agent used 0.19 s
of CPU in 5 s. SGLang builds its agent inside ``NixlKVManager.__init__``, and
that code has no way to set the delay. The harness therefore swaps in a config
class whose ``pthrDelay`` defaults to the paced value, before the manager is
built, in its own worker processes only. The plugin's backends never do this.
"""

import os
import sys
from typing import Optional

# Microseconds between progress calls in harness workers. 0 keeps NIXL's spinning thread.
DELAY_ENV = "SGLANG_DISAGG_EXT_NIXL_PTHR_DELAY_US"
DEFAULT_DELAY_US = 100


def delay_from_env(environ=os.environ) -> int:
    raw = environ.get(DELAY_ENV, "").strip()
    if not raw:
        return DEFAULT_DELAY_US
    if not raw.isdecimal():
        raise ValueError(f"{DELAY_ENV}={raw!r}: expected microseconds as a whole number >= 0")
    return int(raw)


class _BindingWithConfig:
    """NIXL's binding module, except ``nixlAgentConfig``; ``nixl_agent`` reads both through one name."""

    def __init__(self, binding, config_class):
        self._binding = binding
        self.nixlAgentConfig = config_class

    def __getattr__(self, name):
        return getattr(self._binding, name)


def pace_progress_thread(delay_us: int) -> Optional[str]:
    """Every ``nixl_agent`` made later in this process gets ``pthrDelay = delay_us``.

    Returns None when applied (or when ``delay_us`` is 0, which changes nothing).
    Otherwise it returns why not, for the worker's report. A NIXL whose API does
    not look as described above is left alone.
    """
    if delay_us == 0:
        return None
    try:
        import nixl._api as api
    except ImportError as exc:
        return f"nixl not importable: {exc}"
    module = sys.modules.get(api.nixl_agent.__module__)
    binding = getattr(module, "nixlBind", None)
    if isinstance(binding, _BindingWithConfig):
        return None  # already paced in this process
    base = getattr(binding, "nixlAgentConfig", None)
    field = getattr(base, "pthrDelay", None)
    if field is None or not hasattr(field, "__set__"):
        return f"{getattr(module, '__name__', module)}: nixlAgentConfig has no settable pthrDelay"

    class PacedNixlAgentConfig(base):
        # nixl_agent writes 0 ("spin"); any other value was asked for on purpose.
        pthrDelay = property(field.__get__, lambda config, value: field.__set__(config, value or delay_us))

    module.nixlBind = _BindingWithConfig(binding, PacedNixlAgentConfig)
    return None
