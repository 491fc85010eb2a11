"""F12 scenarios: MoRI on 0.5.23 with SGLang's default (TCP) metadata path.

Same engine boundary as ``scenarios/mori.py`` (SGLang's real MoRI backend in
two harness processes, the MoRI IO engine replaced by the in-repo stand-in),
but without ``SGLANG_MORI_SEND_AUX_RDMA``: the metadata rows go over SGLang's
TCP path, the path F12 is about. Faults come from test-only prefill hooks in
``test/support/aux_wire.py`` (a source checkout only; these rows say n/a
without it):

* ``mori-aux-order`` (hook ``delay_aux_rows``): every metadata-row message
  leaves its ZMQ socket 30 ms late, later messages on that socket queue
  behind it. ``RACE_REQUESTS`` requests, each writing a fresh decode row.
  Stock sends the status on another socket: decode sees Success first and
  its metadata row still holds the sentinel. ``-ext``: every request
  Success, every byte verified.
* ``mori-aux-short-row`` (hook ``shorter_aux_rows``): the prefill's row of
  metadata buffer 1 is 28 bytes, decode's 32. Stock writes the 28 bytes over
  decode's row and reports Success (the tail stays stale); ``-ext`` fails
  the room on both sides with :func:`short_row_reason`, and decode's
  metadata rows stay untouched.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts
from sglang_disagg_ext.selftest.scenarios import mori as mori_rows

FIX = "F12"
RACE_REQUESTS = 200
DELAY_MS = 30
SHORT_BUFFER, SHORT_BY = 1, 4
HOOKS = "aux_wire.py"
TIMEOUTS = Timeouts(request_s=30.0, startup_s=150.0, sglang_waiting_s=4.0, sglang_bootstrap_s=4.0)


def hook_file() -> Optional[str]:
    path = os.path.join(mori_rows._repo_root(), "test", "support", HOOKS)
    return path if os.path.isfile(path) else None


def env(hook: str) -> Dict[str, str]:
    """The stand-in on the children's path, SGLang's default metadata path, and ``hook``."""
    path = hook_file()
    if path is None:
        raise RuntimeError("the F12 hooks live in a source checkout (test/support/aux_wire.py); none here")
    out = mori_rows.standin_env(aux_rdma=False)
    out["SGLANG_HARNESS_PREFILL_HOOK"] = f"{path}:{hook}"
    out["SGLANG_TEST_AUX_DELAY_MS"] = str(DELAY_MS)
    return out


def aux_order(n: int = RACE_REQUESTS) -> Scenario:
    """``n`` requests; request ``i`` moves prefill KV page 1 to decode page 2 and
    prefill metadata row ``i % 8`` to decode row ``i`` (a row no earlier request
    wrote: until its own row lands it holds the sentinel)."""
    return Scenario(
        name="mori-aux-order",
        kv=KVPoolSpec(num_pages=4),
        aux_rows=n,
        requests=[RequestSpec(src_kv_pages=[1], dst_kv_pages=[2], aux_index=i % 8, dst_aux_index=i) for i in range(n)],
        timeouts=TIMEOUTS,
    )


def short_row() -> Scenario:
    return Scenario(
        name="mori-aux-short-row",
        kv=KVPoolSpec(num_pages=4),
        requests=[RequestSpec(src_kv_pages=[1], dst_kv_pages=[2], aux_index=1, dst_aux_index=5)],
        timeouts=TIMEOUTS,
    )


def short_row_reason(prefill_len: int, decode_len: int) -> str:
    """What ``-ext`` says for the short row (derived by hand from core.aux_rows' wording)."""
    return (
        f"metadata (aux) buffer {SHORT_BUFFER}, row 5: {prefill_len} bytes sent, "
        f"decode row is {decode_len} bytes"
    )


def run(scenario: Scenario, backend: str, hook: str, timeout_s: float = 240.0):
    from sglang_disagg_ext.selftest.harness.run import run_scenario

    return run_scenario(scenario, backend, timeout_s=timeout_s, extra_env=env(hook))


def stale_rows(request_result) -> bool:
    """Decode reported Success and a metadata (aux) row of this request still held the sentinel."""
    return request_result.decode_status == "Success" and any(
        m.startswith("aux") and "sentinel" in m for m in request_result.mismatches
    )
