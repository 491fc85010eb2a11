"""Test-only decode hook for the harness worker (``SGLANG_HARNESS_DECODE_HOOK``).

``flip_one_byte`` flips byte 0 of one decode page (buffer 0) after the transfer
and before the worker verifies, with ``SGLANG_HARNESS_TAMPER=<pool name>:<page>``
naming the page: the harness's own test that the verification sees a single
wrong byte. It lives here, outside the wheel.
"""

import os

TAMPER_ENV = "SGLANG_HARNESS_TAMPER"


def flip_one_byte(pools, rec) -> None:
    spec = os.environ[TAMPER_ENV]
    name, _, page = spec.rpartition(":")
    for pool in pools:
        if pool.name == name:
            pool.views[0][int(page), 0] ^= 0xFF
            rec["tampered"] = spec
            return
    raise ValueError(f"{TAMPER_ENV}={spec!r}: no pool named {name!r}")
