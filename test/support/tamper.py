"""Test-only decode hook for the harness worker (``SGLANG_HARNESS_DECODE_HOOK``).

``flip_one_byte`` flips byte 0 of one decode page (buffer 0) after the transfer
and before the worker verifies, with ``SGLANG_HARNESS_TAMPER=<pool name>:<page>``
naming the page: the harness's own test that the verification sees a single
wrong byte. ``SGLANG_HARNESS_TAMPER_REQUEST=<index>`` flips after that request
only (default: after every request), e.g. into a page an earlier request wrote.
It lives here, outside the wheel.
"""

import os

TAMPER_ENV = "SGLANG_HARNESS_TAMPER"
TAMPER_REQUEST_ENV = "SGLANG_HARNESS_TAMPER_REQUEST"


def flip_one_byte(pools, rec) -> None:
    spec = os.environ[TAMPER_ENV]
    only = os.environ.get(TAMPER_REQUEST_ENV)
    if only is not None and int(only) != rec["index"]:
        return
    name, _, page = spec.rpartition(":")
    for pool in pools:
        if pool.name == name:
            pool.views[0][int(page), 0] ^= 0xFF
            rec["tampered"] = spec
            return
    raise ValueError(f"{TAMPER_ENV}={spec!r}: no pool named {name!r}")
