"""Verified transfers: the switch, and where it can work.

``SGLANG_DISAGG_EXT_VERIFY=1`` in the scheduler's environment (off by default)
asks every ``-ext`` backend that can to prove its bytes: prefill digests what
it writes at its destination placement, decode recomputes the digest over what
landed before it reports Success; a room that arrives without every prefill
rank's digest (a stock prefill) succeeds, counted ``unverified``. ``=require``
fails such a room on decode instead, naming how many digests came (``core/digest.py``,
``backends/common/verify.py``, ``backends/mooncake/verify.py``, ``backends/nixl/verify.py``). This module is light (no torch, no SGLang at
import) so that ``doctor`` and ``selftest`` can say what the switch does here.
"""

from __future__ import annotations

import os
import logging
from typing import Callable, Dict, Optional

from sglang_disagg_ext import releases

VERIFY_ENV = "SGLANG_DISAGG_EXT_VERIFY"


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
# Fail closed: a room that arrives without every prefill rank's digest ends Failed instead of
# concluding Success unverified (a stock or older prefill, a rank that sent none).
_REQUIRE = ("require",)


def _setting() -> str:
    return os.environ.get(VERIFY_ENV, "").strip().lower()


def enabled() -> bool:
    """Whether ``SGLANG_DISAGG_EXT_VERIFY`` asks for verified transfers (off by default)."""
    return _setting() in _ON + _REQUIRE


def required() -> bool:
    """Whether it asks to fail closed (``require``): a decode fails a room it cannot check."""
    return _setting() in _REQUIRE


def mode() -> str:
    """``off``, ``on`` (unverifiable rooms succeed, counted ``unverified``) or ``require``."""
    return "require" if required() else "on" if enabled() else "off"


def invalid_setting() -> Optional[str]:
    """Why ``SGLANG_DISAGG_EXT_VERIFY`` is neither on nor off (``None`` when it is one of them).

    Such a value leaves verification off; doctor reports it as a problem and the first
    ``-ext`` manager logs it as an ERROR, so a typo never turns the check off silently."""
    if _setting() in _ON + _OFF + _REQUIRE:
        return None
    value = os.environ.get(VERIFY_ENV, "")
    return (f"{VERIFY_ENV}={value!r} is neither on ({', '.join(_ON)}), {_REQUIRE[0]} (on, failing rooms that "
            f"arrive without a digest) nor off ({', '.join(repr(v) for v in _OFF)}): verified transfers stay off")


def available(policy: releases.ReleasePolicy) -> Dict[str, str]:
    """Per ``-ext`` backend: ``""`` where verification works on this release, else why not.

    Both need the plugin's classes (the backend routes) and a way for the digest
    to travel with prefill's Success: SGLang's common status codec (0.5.20+), which
    reads the status frames by position and ignores a trailing one; or, on Mooncake up to
    0.5.19, whose decode loop unpacks exactly three frames, the fourth frame the
    ``-ext`` peers already exchange (F6/F9's pool-sizes registration frame says which
    decode takes it; ``backends/mooncake/peers``). A NIXL decode that learns Success from that
    message alone (0.5.23) takes it there; one that concludes from NIXL notifications alone
    (up to 0.5.22: NIXL's prefill sends no Success message, ``backends/nixl/verify``) takes it from
    the room's aux notification.
    """
    out = {}
    if not policy.supported:
        reason = f"SGLang {policy.version or '(not installed)'} is not supported"
        return {ext: reason for ext in releases.EXT_BACKENDS}
    for ext, base in releases.EXT_BACKENDS.items():
        if not policy.routes(base):
            out[ext] = f"{ext} passes through to stock on SGLang {policy.version}"
        elif base == "mooncake" and not releases.features().kv_status_codec and not (
                policy.is_live("F6") or policy.is_live("F9")):
            # Up to 0.5.19 the digest rides on the fourth status frame that F6/F9's peer
            # exchange (backends/mooncake/peers) sends to an -ext decode; without it, nowhere.
            out[ext] = (f"SGLang {policy.version} has no common status codec (parse_kv_status_message, "
                        "0.5.20+) and these sources carry F6 and F9, whose peer exchange would carry the digest")
        elif base == "mori" and not (
                releases.features().mori_status_codec or releases.features().mori_sender_notifies_status):
            out[ext] = (f"MoRI on SGLang {policy.version} concludes rooms neither through SGLang's common "
                        "status codec (0.5.20+) nor through its own status message (up to 0.5.19)")
        elif base == "nixl" and not (releases.features().nixl_success_via_listener_only
                                     or releases.features().nixl_success_via_notifications_only):
            # One way in, one digest: the status message (0.5.23) or the aux notification
            # (up to 0.5.22, backends/nixl/verify). A release where neither probe holds is not verified.
            out[ext] = (f"a NIXL decode on SGLang {policy.version} does not conclude Success from one path the "
                        "plugin can carry the digest on (prefill's status message alone, or NIXL notifications "
                        "alone)")
        else:
            out[ext] = ""
    return out


def with_verification(cls: type, ext: str, policy: releases.ReleasePolicy, mixin: Callable[[], type],
                      log: logging.Logger) -> type:
    """``cls`` with the verified-transfer ``mixin()`` in front (outermost: its digest sees every
    engine write the fixes let through, its decode check runs before any Success) where the
    switch asks for it and :func:`available` says ``ext`` can verify on this release; else
    ``cls``, with a warning naming why when the switch is on. ``mixin`` is imported only then
    (it brings torch)."""
    if not enabled():
        return cls
    why = available(policy).get(ext, "")
    if why:
        log.warning("%s=1: %s; %s transfers are not verified", VERIFY_ENV, why, ext)
        return cls
    m = mixin()
    return type(f"{cls.__name__}_V", (m, cls),
                {"__module__": cls.__module__, "__doc__": f"{cls.__doc__} With {m.__name__}."})
