"""F11 scenarios: NIXL on 0.5.22 and 0.5.23, prefill and decode TP sizes differ (non-MLA, head-sliced path).

One process per rank, real UCX over 127.0.0.1, CPU pools registered through the
harness's host-memory shim on both sides (``harness/nixl_shim.py``: 0.5.23's
stock memory handling, which F11 keeps, refuses host memory across TP sizes
before any code F11 is about runs). Expected texts are written out by hand:

* **SWA page lists of different lengths** (``swa_unequal``): request 0 sends
  SWA pages [1, 2, 3] to decode pages [4, 5], request 1 [7] to [9, 10],
  request 2 [8] to [11] (equal: the control). 0.5.23 Mooncake cuts the longer
  list to the shorter one's length, leading pages kept (mooncake/conn.py:
  2145-2161); stock NIXL fails requests 0 and 1 on every rank with
  "Head-sliced PD transfer page count mismatch: prefill=3, decode=2" and
  "... prefill=1, decode=2" (common/conn.py:1802-1806). ``-ext``: all three
  Success, decode holds prefill page 1 -> 4, 2 -> 5, 7 -> 9 (the harness
  verifies the first min(len) pairs per head, every other page the sentinel).
  Run for prefill TP 2 -> decode TP 1, 1 -> 2 and 1 -> 4 (2 KV heads: each
  of the 4 decode ranks holds a replica of one head).
  At equal TP (1 -> 1) stock fails the same lists with "State index length
  mismatch at component 0: prefill=3, dst=2" (nixl/conn.py:3230-3233).
* **3 KV heads, prefill TP 1 -> decode TP 2** (``three_heads``): no head
  split exists (3 % 2 = 1). Stock asserts in ``_init_hetero_tp_prep_handle``
  (nixl/conn.py:1311) on the bootstrap thread, which dies; both requests end
  only through SGLang's timeouts. ``-ext``: refused at registration; both
  requests Failed on both sides at once with :func:`three_heads_reason`.
* **SWA pool with 1 head under a 2-head model, prefill TP 2 -> decode TP 1**
  (``swa_heads``): stock slices SWA with the model's KV head count and fails
  each request at transfer time ("KV item lengths (prefill=64, decode=64) do
  not split into 1 and 2 heads of 2 total with page_size=4",
  common/conn.py:1825-1833) after its KV pages went out. ``-ext``: refused at
  registration naming the SWA component: 64-byte pages of 4 tokens hold 16
  bytes per head with 1 head per prefill rank, 8 with 2 heads per decode rank.
* **A registration that raises** (``registration_fault``, test-only prefill
  hook ``raise_in_registration``: stock ``_add_remote_peer``'s
  ``_prepare_payload_xfer`` call raises once, for decode TP rank 0): stock's
  bootstrap thread dies (``InjectedFault`` in the thread errors) and both
  requests time out; ``-ext`` refuses that decode rank with the exception in
  the reason, both requests Failed on both sides at once, and the thread goes
  on (decode rank 1's registration and both rooms' messages are served after
  the fault: otherwise no room could conclude).
* **The decode listener raises** (``listener_fault``, test-only decode hook
  ``raise_on_status_success``: decode's ``update_status(1000, Success)``,
  called by ``apply_prefill_status`` on the listener thread for prefill's
  Success message, raises once): stock's ``decode_listener_thread`` dies
  (``InjectedFault`` in the thread errors) and both rooms end on decode only
  by SGLang's waiting timeout (no later status reaches decode); ``-ext``: room
  1000 Failed on decode at once with :data:`LISTENER_FAULT_REASON` (prefill
  had concluded it Success), room 1001 Success with every byte checked.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)
from sglang_disagg_ext.selftest.scenarios.nixl import NixlScenario, builtin_scenarios

# SGLang's own timeouts short: a stock room nobody concludes ends in 5 s.
TIMEOUTS = Timeouts(request_s=60.0, startup_s=150.0, sglang_waiting_s=5.0, sglang_bootstrap_s=5.0)
# A scenario no run waits out (stock fails it with its own error, -ext serves it): long bounds
# cost nothing there, and a loaded CI machine (0.5.23) once started a decode rank of the
# TP 1 -> 4 run 5.1 s late, past TIMEOUTS, so -ext's served room timed out.
CONCLUDED_TIMEOUTS = Timeouts(request_s=60.0, startup_s=150.0, sglang_waiting_s=30.0, sglang_bootstrap_s=30.0)
# -ext concludes refused rooms at once: decode must end them Failed before SGLang's 5 s bound
# could (a room that ends before it was told; one that waits it out takes >= 5 s). 1 s of margin,
# not half the bound: a loaded CI leg (0.5.17) once took 2.8 s to tell decode.
FAILED_WITHIN_S = TIMEOUTS.sglang_waiting_s - 1.0
HEAD_DIM = 8  # bf16: 16 bytes per head per token
PREFILL_HOOK = "raise_in_registration"
DECODE_MANAGER_HOOK = "raise_on_status_success"
# The failed-room variant: prefill fails room 1000 (its send_aux raises, after the KV pages went
# out), decode's handler of that Failed message raises.
FAILED_ROOM_PREFILL_HOOK = "raise_in_nixl_send_aux"
FAILED_ROOM_DECODE_HOOK = "raise_on_failure_record"


def swa_unequal(p: int, d: int) -> Scenario:
    return Scenario(
        name=f"nixl swa unequal lists tp{p}->tp{d}",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=0, dst_aux_index=1, state=[StateSpec("swa", [1, 2, 3], [4, 5])]),
            RequestSpec([5], [6], aux_index=1, dst_aux_index=2, state=[StateSpec("swa", [7], [9, 10])]),
            RequestSpec([6], [7], aux_index=2, dst_aux_index=3, state=[StateSpec("swa", [8], [11])]),
        ],
        kv=KVPoolSpec(num_pages=8, head_num=2, head_dim=HEAD_DIM),
        state_pools=[StatePoolSpec(kind="swa", num_pages=12, head_num=2, head_dim=HEAD_DIM)],
        prefill_tp=p,
        decode_tp=d,
        timeouts=CONCLUDED_TIMEOUTS,
    )


# Stock's per-request signature for requests 0 and 1 of swa_unequal.
def stock_swa_mismatch(p: int, d: int, index: int) -> str:
    src, dst = ((3, 2), (1, 2))[index]
    if p == d:
        return f"State index length mismatch at component 0: prefill={src}, dst={dst}"
    return f"Head-sliced PD transfer page count mismatch: prefill={src}, decode={dst}"


TRIM_LINE = (
    "state component 0 (swa): len(prefill_state_indices)=3, len(dst_state_indices)=2; "
    "sending the first 2 pages (prefill side trimmed)"
)


def three_heads() -> Scenario:
    return Scenario(
        name="nixl 3 kv heads tp1->tp2",
        requests=[
            RequestSpec([1, 2, 3], [5, 6, 7], aux_index=1, dst_aux_index=2),
            RequestSpec([4], [3], aux_index=2, dst_aux_index=3),
        ],
        kv=KVPoolSpec(num_pages=9, head_num=3, head_dim=HEAD_DIM),
        hidden_size=96,  # a multiple of the 3 heads (SGLang's model config checks it)
        prefill_tp=1,
        decode_tp=2,
        timeouts=TIMEOUTS,
    )


def three_heads_reason() -> str:
    return (
        "decode TP rank 0 refused at registration: KV cannot be head-sliced from prefill TP 1 to decode TP 2 "
        "with 3 KV heads (3 per prefill rank, 1 per decode rank): decode TP size 2 does not divide the 3 KV "
        "heads (3 % 2 = 1)"
    )


def swa_heads() -> Scenario:
    return Scenario(
        name="nixl swa pool heads differ tp2->tp1",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=0, dst_aux_index=1, state=[StateSpec("swa", [1, 2], [4, 5])]),
        ],
        kv=KVPoolSpec(num_pages=8, head_num=2, head_dim=HEAD_DIM),
        state_pools=[StatePoolSpec(kind="swa", num_pages=12, head_num=1, head_dim=HEAD_DIM)],
        prefill_tp=2,
        decode_tp=1,
        timeouts=TIMEOUTS,
    )


SWA_HEADS_REASON = (
    "decode TP rank 0 refused at registration: SWA state (component 0) cannot be head-sliced from prefill TP 2 "
    "to decode TP 1 with 2 KV heads (1 per prefill rank, 2 per decode rank): buffer 0: one head is 16 bytes "
    "per token on prefill but 8 on decode"
)
STOCK_SWA_HEADS = "KV item lengths (prefill=64, decode=64) do not split into 1 and 2 heads of 2 total with page_size=4"


def registration_fault() -> Scenario:
    return Scenario(
        name="nixl registration raises tp1->tp2",
        requests=[
            RequestSpec([1, 2], [5, 6], aux_index=1, dst_aux_index=2),
            RequestSpec([3], [7], aux_index=2, dst_aux_index=3),
        ],
        kv=KVPoolSpec(num_pages=9, head_num=2, head_dim=HEAD_DIM),
        prefill_tp=1,
        decode_tp=2,
        timeouts=TIMEOUTS,
    )


# Each side runs its rooms one after another. On stock, decode starts room 1001 only when
# room 1000 has waited out the 5 s waiting timeout, while prefill's room 1001 has been
# bootstrapping since room 1000 ended: with a 5 s bootstrap timeout the two raced (decode
# registered 1001 at +4.94 s; on a loaded machine prefill timed it out first, clean-clone CI
# of e52cf56). Prefill's bootstrap timeout is eight waiting timeouts here, so that harness
# artefact never decides room 1001 (three were not enough once: stock decode's room 1000 took
# 14.4 s to time out under load, clean-clone CI of 66f7d70); the waiting timeout, which the
# tests measure, is unchanged.
LISTENER_FAULT_TIMEOUTS = dataclasses.replace(TIMEOUTS, sglang_bootstrap_s=8 * TIMEOUTS.sglang_waiting_s)


def listener_fault() -> Scenario:
    return Scenario(
        name="nixl decode listener raises tp1->tp1",
        requests=[
            RequestSpec([1, 2], [5, 6], aux_index=1, dst_aux_index=2),
            RequestSpec([3], [7], aux_index=2, dst_aux_index=3),
        ],
        kv=KVPoolSpec(num_pages=9, head_num=2, head_dim=HEAD_DIM),
        timeouts=LISTENER_FAULT_TIMEOUTS,
    )


LISTENER_FAULT = "injected fault: decode status handler for room 1000"
FAILED_ROOM_FAULT = "injected fault: decode failure handler for room 1000"
FAILED_ROOM_FAULT_REASON = (
    f"nixl-ext (F11) decode listener: apply_prefill_status raised InjectedFault: {FAILED_ROOM_FAULT}; "
    "the room is failed, the thread keeps serving"
)
LISTENER_FAULT_REASON = (
    f"nixl-ext (F11) decode listener: apply_prefill_status raised InjectedFault: {LISTENER_FAULT}; "
    "the room is failed, the thread keeps serving"
)
FAULT = "injected fault: registration of decode TP rank 0"
# raise_in_nixl_send_aux's exception for room 1000's aux row; prefill records str(exception).
SEND_AUX_FAULT = "injected fault: send_aux for aux row 1"
REGISTRATION_FAULT_REASON = f"decode TP rank 0 refused: its registration raised InjectedFault: {FAULT}"


# -- selftest rows (``scenarios.nixl_rows`` on a release where F11 is live) ------------------


def refused_ok(want: str):
    """Passed: every request Failed on both sides with ``want`` in both reasons, decode within
    FAILED_WITHIN_S (not SGLang's timeouts), nothing written outside the targeted pages."""

    def passed(result) -> bool:
        if result.error or not result.requests:
            return False
        for r in result.requests:
            if r.prefill_status != "Failed" or r.decode_status != "Failed":
                return False
            if want not in (r.prefill_failure_reason or "") or want not in (r.decode_failure_reason or ""):
                return False
            if r.decode_seconds is None or r.decode_seconds >= FAILED_WITHIN_S:
                return False
            if any("must be untouched" in m for m in r.mismatches):
                return False
        return True

    return passed


def listener_survived(result) -> bool:
    """Passed: room 1000 Success on prefill, Failed on decode with the listener-fault reason within
    FAILED_WITHIN_S, nothing written outside its pages; room 1001 ok (byte-checked); no thread died."""
    return result.first_room_failed_then_served("Success", LISTENER_FAULT_REASON, FAILED_WITHIN_S)


def failed_room_listener_survived(result) -> bool:
    """Passed: room 1000 Failed on both sides, on decode with the listener-fault reason within
    FAILED_WITHIN_S (not SGLang's waiting timeout), nothing written outside its pages; room 1001
    ok (byte-checked); no thread died."""
    return result.first_room_failed_then_served("Failed", FAILED_ROOM_FAULT_REASON, FAILED_WITHIN_S)


def _all_ok(result) -> bool:
    return result.ok


def _stock_fails_where_live(policy) -> str:
    return "fail" if policy.is_live("F11") else "pass"


SUCCESS_VIA_LISTENER_ROW = "decode listener raises on Success tp1->tp1"


def _rows():
    def row(name, build, passed, **kw):
        return NixlScenario(name, build, passed, _stock_fails_where_live, fix="F11", ext_shim=True, **kw)

    out = [row(f"swa unequal page lists tp{p}->tp{d}", lambda p=p, d=d: swa_unequal(p, d), _all_ok)
           for p, d in ((2, 1), (1, 2), (1, 4), (1, 1))]
    out.append(row("3 kv heads tp1->tp2 refused at registration", three_heads, refused_ok(three_heads_reason())))
    out.append(row("swa heads differ tp2->tp1 refused at registration", swa_heads, refused_ok(SWA_HEADS_REASON)))
    out.append(row("registration raises tp1->tp2", registration_fault, refused_ok(REGISTRATION_FAULT_REASON),
                   prefill_hook=PREFILL_HOOK))
    out.append(row(SUCCESS_VIA_LISTENER_ROW, listener_fault, listener_survived, decode_hook=DECODE_MANAGER_HOOK))
    out.append(row("decode listener raises on Failed tp1->tp1", listener_fault, failed_room_listener_survived,
                   prefill_hook=FAILED_ROOM_PREFILL_HOOK, decode_hook=FAILED_ROOM_DECODE_HOOK))
    return out



SCENARIOS = _rows()


def _f13_rows() -> list:
    """F13's class shares F11's registration refusal and pair check (0.5.13-0.5.21): the same
    refusals, and up to 0.5.19, where stock never tells decode of a prefill-side failure, one
    that decode hears of at once."""
    from sglang_disagg_ext import releases
    from sglang_disagg_ext.selftest.scenarios.nixl import _always_fail

    def row(name, build, passed, **kw):
        return NixlScenario(name, build, passed, _always_fail, fix="F13", ext_shim=True, **kw)

    out = [
        row("swa heads differ tp2->tp1 refused at registration", swa_heads, refused_ok(SWA_HEADS_REASON)),
        row("registration raises tp1->tp2", registration_fault, refused_ok(REGISTRATION_FAULT_REASON),
            prefill_hook=PREFILL_HOOK),
    ]
    if not releases.features().nixl_conclude_failure:
        out.append(row("prefill send_aux raises tp1->tp1, decode told", listener_fault,
                       lambda r: r.first_room_failed_then_served("Failed", SEND_AUX_FAULT, FAILED_WITHIN_S),
                       prefill_hook=FAILED_ROOM_PREFILL_HOOK))
    if not releases.features().nixl_bootstrap_handles_abort:
        # Up to 0.5.15 decode's ABORT (sent when it times a room out) kills stock's bootstrap thread.
        out.append(row("decode aborts a lost room tp1->tp1, next served", listener_fault, _abort_survived,
                       prefill_hook=LOST_TRANSFER_HOOK))
    return out


LOST_TRANSFER_HOOK = "lose_first_transfer"
ABORT_REASON = "Aborted by decode-side abort notification."  # SGLang's text (0.5.16 nixl/conn.py:2366)


def _abort_survived(result) -> bool:
    """Passed: room 1000 (transfer lost) Failed on prefill by decode's abort, room 1001 ok with
    every byte checked, no thread died."""
    if result.error or len(result.requests) != 2:
        return False
    lost, after = result.requests
    return (lost.prefill_failure_reason == ABORT_REASON and after.ok
            and not any(r.thread_errors for r in result.requests))


# The one n/a row of ``nixl_rows`` where nixl-ext passes through to SGLang's classes.
PASSTHROUGH_ROW = "nixl-ext routes to stock classes on this release"

# Why a scenario with a test-only manager hook is "n/a" outside a source checkout
# (``nixl_rows`` and ``selftest --list``).
NO_HOOKS_WHY = ("no source checkout: the fault hook (test/support/prefill_faults.py) "
                "that makes a manager method raise is not in the wheel")


def hook_not_run_reason(builtin, hooks) -> Optional[str]:
    """Why ``builtin`` is "n/a" here for want of the test-only hooks (``hooks``: their file, or
    None outside a source checkout), else None; one rule for the run and for ``--list``."""
    return NO_HOOKS_WHY if (builtin.prefill_hook or builtin.decode_hook) and hooks is None else None


def passthrough_reason(policy) -> str:
    """The note of ``PASSTHROUGH_ROW``: the release and its support."""
    return f"SGLang {policy.version}: {policy.support.value}"


def nixl_scenarios(policy) -> list:
    """The built-in NIXL scenarios of ``policy``'s release: F11's where it is live (0.5.22, 0.5.23), F13's
    (with :func:`_f13_rows`) where that is (0.5.13-0.5.21), else F4's.

    The Success-message listener row runs only where that message is decode's one source of
    Success (0.5.23); on 0.5.22 decode concludes Success from NIXL notifications itself, so the
    fault it injects is never reached there (the Failed-message row covers that release)."""
    if policy.is_live("F13"):
        from sglang_disagg_ext.selftest.scenarios.nixl import f13_scenarios

        return f13_scenarios() + _f13_rows()
    if not policy.is_live("F11"):
        return builtin_scenarios()
    from sglang_disagg_ext import releases

    if releases.features().nixl_success_via_listener_only:
        return list(SCENARIOS)
    return [s for s in SCENARIOS if s.name != SUCCESS_VIA_LISTENER_ROW]
