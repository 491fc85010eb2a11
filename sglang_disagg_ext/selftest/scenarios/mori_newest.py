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

import dataclasses

import os
import time
from typing import Dict, List, Optional

from sglang_disagg_ext import releases

from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts
from sglang_disagg_ext.selftest.scenarios import mori as mori_rows

FIX = "F12"
RACE_REQUESTS = 200
# The selftest row's share of the race (the test runs RACE_REQUESTS): with every row
# message 30 ms late, stock shows a stale row from the first request on.
ROW_REQUESTS = 20
ROW_NAMES = ("mori-aux-order", "mori-aux-short-row", "mori-status-worker-fault", "mori-transfer-message-fault")
DELAY_MS = 30
SHORT_BUFFER, SHORT_BY = 1, 4
HOOKS = "aux_wire.py"
# The short row and the aux-order race end on checks, never on a timeout (short row: stock
# Success, -ext Failed at once; race: both sides serve every request): SGLang's bounds are
# loose so that a loaded machine cannot decide them (CI once saw decode's first request start
# 2.1 s late and prefill's 4 s bootstrap bound end it).
CONCLUDED_TIMEOUTS = Timeouts(request_s=40.0, startup_s=150.0, sglang_waiting_s=15.0, sglang_bootstrap_s=15.0)
# A room -ext concludes Failed under CONCLUDED_TIMEOUTS ends well before the 15 s wait-out; half
# of it, not 2 s, so a decode started late on a loaded machine (2.5 s once) still reads as told.
CONCLUDED_WITHIN_S = CONCLUDED_TIMEOUTS.sglang_waiting_s / 2


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
        timeouts=CONCLUDED_TIMEOUTS,
    )


def short_row() -> Scenario:
    return Scenario(
        name="mori-aux-short-row",
        kv=KVPoolSpec(num_pages=4),
        requests=[RequestSpec(src_kv_pages=[1], dst_kv_pages=[2], aux_index=1, dst_aux_index=5)],
        timeouts=CONCLUDED_TIMEOUTS,
    )


def short_row_reason(prefill_len: int, decode_len: int) -> str:
    """What ``-ext`` says for the short row (derived by hand from core.aux_rows' wording)."""
    return (
        f"metadata (aux) buffer {SHORT_BUFFER}, row 5: {prefill_len} bytes sent, "
        f"decode row is {decode_len} bytes"
    )


# -- the decode status worker (a status message whose handling raises) -----------------------
# Decode hook in test/support/prefill_faults.py: decode's update_status(1000, Success), which
# apply_prefill_status calls on the status worker for prefill's Success message, raises once.
STATUS_FAULT_HOOK = "raise_on_status_success"
STATUS_FAULT = "injected fault: decode status handler for room 1000"
STATUS_FAULT_REASON = (
    f"mori-ext decode status worker: apply_prefill_status raised InjectedFault: {STATUS_FAULT}; "
    "the room is failed, the thread keeps serving"
)
# The rooms run one after another on each side: on stock, decode starts room 1001 only after
# room 1000 waited out the waiting timeout, while prefill's room 1001 bootstraps from room
# 1000's end; a bootstrap timeout of three waiting timeouts keeps that harness artefact from
# deciding room 1001 (as nixl_newest.LISTENER_FAULT_TIMEOUTS).
STATUS_FAULT_TIMEOUTS = Timeouts(request_s=30.0, startup_s=150.0, sglang_waiting_s=4.0, sglang_bootstrap_s=12.0)
# -ext fails room 1000 on decode at once, with prefill's reason (a wait-out would carry SGLang's
# timeout reason and take >= 4 s). Half a second under the 4 s bound, not 2 s: a loaded CI leg
# (0.5.22) started a decode 2.5 s late and told it at 2.7 s.
FAILED_WITHIN_S = STATUS_FAULT_TIMEOUTS.sglang_waiting_s - 0.5


def status_fault() -> Scenario:
    """Two requests: KV page 1 -> 2 and metadata row 1 -> 2, then page 3 -> 3 and row 2 -> 3."""
    return Scenario(
        name="mori decode status worker raises",
        kv=KVPoolSpec(num_pages=4),
        requests=[
            RequestSpec(src_kv_pages=[1], dst_kv_pages=[2], aux_index=1, dst_aux_index=2),
            RequestSpec(src_kv_pages=[3], dst_kv_pages=[3], aux_index=2, dst_aux_index=3),
        ],
        timeouts=STATUS_FAULT_TIMEOUTS,
    )


def _fault_env(variable: str, hook: str) -> Dict[str, str]:
    """The stand-in, metadata rows through the engine (a thread fault, not F12's race, is what
    these scenarios are about), and one hook of test/support/prefill_faults.py in ``variable``."""
    from sglang_disagg_ext.selftest.harness.run import fault_hooks_path

    path = fault_hooks_path()
    if path is None:
        raise RuntimeError("the fault hooks live in a source checkout (test/support/prefill_faults.py); none here")
    out = mori_rows.standin_env(aux_rdma=True)
    out[variable] = f"{path}:{hook}"
    return out


def status_fault_env() -> Dict[str, str]:
    """:func:`_fault_env` with the decode hook."""
    return _fault_env("SGLANG_HARNESS_DECODE_MANAGER_HOOK", STATUS_FAULT_HOOK)


def status_worker_survived(result) -> bool:
    """-ext: room 1000 Success on prefill, Failed on decode with :data:`STATUS_FAULT_REASON` within
    :data:`FAILED_WITHIN_S`, nothing written outside its pages; room 1001 Success with every byte
    checked (the worker served after the fault); no thread died."""
    return result.first_room_failed_then_served("Success", STATUS_FAULT_REASON, FAILED_WITHIN_S)


def status_fault_stock_signature(result) -> bool:
    """Stock: room 1000 Success on prefill but held on decode until SGLang's waiting timeout
    (the worker logged the exception and left the room); room 1001 Success (the loop went on)."""
    if result.error or len(result.requests) != 2:
        return False
    bad, good = result.requests
    waited = STATUS_FAULT_TIMEOUTS.sglang_waiting_s
    return (
        (bad.prefill_status, bad.decode_status) == ("Success", "Failed")
        and "timed out" in (bad.decode_failure_reason or "")
        and bad.decode_seconds is not None and bad.decode_seconds >= waited - 0.5
        and (good.prefill_status, good.decode_status) == ("Success", "Success")
    )


# -- the prefill bootstrap thread (a decode's transfer message whose handling raises) --------
# Prefill hook in test/support/prefill_faults.py: prefill's update_status(1000, WaitingForInput),
# the last step of _handle_transfer_message on the bootstrap thread, raises once.
TRANSFER_FAULT_HOOK = "raise_on_waiting_for_input"
TRANSFER_FAULT = "injected fault: bootstrap message handler for room 1000"
TRANSFER_FAULT_REASON = (
    f"mori-ext prefill bootstrap thread: decode's transfer message raised InjectedFault: {TRANSFER_FAULT}; "
    "the room is failed, the thread keeps serving"
)


def transfer_fault() -> Scenario:
    """As :func:`status_fault`: two requests, the first one's transfer message meets the fault."""
    scn = status_fault()
    return dataclasses.replace(scn, name="mori prefill transfer message handler raises")


def transfer_fault_env() -> Dict[str, str]:
    """:func:`_fault_env` with the prefill hook."""
    return _fault_env("SGLANG_HARNESS_PREFILL_HOOK", TRANSFER_FAULT_HOOK)


def transfer_fault_handled(result) -> bool:
    """-ext: room 1000 Failed on prefill with :data:`TRANSFER_FAULT_REASON` and on decode, told with
    that reason within :data:`FAILED_WITHIN_S`, nothing written outside its pages; room 1001
    Success with every byte checked (the bootstrap thread served it); no thread died."""
    if result.error or len(result.requests) != 2:
        return False
    bad, good = result.requests
    return (
        (bad.prefill_status, bad.decode_status) == ("Failed", "Failed")
        and TRANSFER_FAULT_REASON in (bad.prefill_failure_reason or "")
        and TRANSFER_FAULT_REASON in (bad.decode_failure_reason or "")
        and bad.decode_seconds is not None and bad.decode_seconds < FAILED_WITHIN_S
        and not any("must be untouched" in m for m in bad.mismatches)
        and good.ok
        and not any(r.thread_errors for r in result.requests)
    )


def transfer_fault_stock_signature(result) -> bool:
    """Stock: room 1000 held on decode until SGLang's waiting timeout (prefill logged the exception
    and left the room Bootstrapping; decode is never told); room 1001 Success (the loop went on)."""
    if result.error or len(result.requests) != 2:
        return False
    bad, good = result.requests
    waited = STATUS_FAULT_TIMEOUTS.sglang_waiting_s
    return (
        bad.decode_status == "Failed"
        and "timed out" in (bad.decode_failure_reason or "")
        and bad.decode_seconds is not None and bad.decode_seconds >= waited - 0.5
        and bad.prefill_status != "Success"
        and (good.prefill_status, good.decode_status) == ("Success", "Success")
    )


def run(scenario: Scenario, backend: str, hook: str, timeout_s: float = 240.0):
    from sglang_disagg_ext.selftest.harness.run import run_scenario

    return run_scenario(scenario, backend, timeout_s=timeout_s, extra_env=env(hook))


def stale_rows(request_result) -> bool:
    """Decode reported Success and a metadata (aux) row of this request still held the sentinel."""
    return request_result.decode_status == "Success" and any(
        m.startswith("aux") and "sentinel" in m for m in request_result.mismatches
    )


def short_row_failed_cleanly(result) -> bool:
    """-ext on ``short_row``: Failed on both sides with the reason, well before a timeout,
    no metadata row written and nothing outside the request's pages touched."""
    if result.error or len(result.requests) != 1:
        return False
    (r,) = result.requests
    reason = short_row_reason(60, 64)
    aux = [m for m in r.mismatches if m.startswith("aux ")]
    return (
        (r.prefill_status, r.decode_status) == ("Failed", "Failed")
        and reason in (r.prefill_failure_reason or "") and reason in (r.decode_failure_reason or "")
        and r.decode_seconds is not None and r.decode_seconds < CONCLUDED_WITHIN_S
        and bool(aux) and all("found the sentinel" in m for m in aux)
        and not any("must be untouched" in m for m in r.mismatches)
    )


def short_row_stock_signature(result) -> bool:
    """Stock on ``short_row``: Success on both sides with the row's last 4 bytes still stale."""
    return len(result.requests) == 1 and any(
        (r.prefill_status, r.decode_status) == ("Success", "Success")
        and any(m.startswith("aux buffer 1 page 5:") and "4/64 bytes still sentinel" in m for m in r.mismatches)
        for r in result.requests
    )


def static_not_run_reason(policy, real_engine: bool, options) -> Optional[str]:
    """Why every F12 row is "n/a" here, from the release, engine and options alone (None: they
    may run). Shared by the rows and ``selftest --list``; the stand-in's self-check (a child
    process) is left to the run."""
    status = policy.fixes.get(FIX)
    if status is not releases.FixStatus.LIVE:
        return (f"F12 is {status.value if status else 'unknown'} on SGLang {policy.version}: "
                "mori-ext has no F12 class there")
    if real_engine:
        return "the F12 rows inject their faults around the MoRI stand-in's host copies; run test_mori_newest.py"
    if not options.is_default:
        return f"asked for {options.describe()}: the MoRI stand-in has no transports to choose"
    if hook_file() is None:
        return "no source checkout: the F12 fault hooks (test/support/aux_wire.py) are not in the wheel"
    if mori_rows.standin_dir() is None:
        return "stand-in unusable here: no source checkout: test/support/mori_standin is not installed with the plugin"
    return None


def release_not_run_reasons(policy) -> Dict[str, str]:
    """The F12 rows that are "n/a" on the installed release even where F12 is live, with why."""
    if not releases.features().mori_sender_notifies_status:
        return {}
    # Up to 0.5.19 (mori_sender_notifies_status): stock's rows and status leave on one socket
    # from one thread (0.5.12.post1+); on 0.5.10.post1/0.5.11 (a new ZMQ context and socket per
    # message, common/conn.py:371-376) the delay hook stalls the sending thread for the delay,
    # so the status never overtook a row here (5 of 5 rooms, 300 ms). Stock's decode worker
    # handles each status inline, with no per-message method for -ext to guard. The short-row
    # row is F12 there.
    return {
        "mori-aux-order": f"n/a on SGLang {policy.version}: stock's status did not overtake its rows here "
                          "(one socket from one thread, or not shown by the delay hook), so -ext leaves "
                          "the channel as it is and checks the rows",
        "mori-status-worker-fault": f"n/a on SGLang {policy.version}: stock's decode worker handles each status "
                                    "inline (no apply_prefill_status to guard)",
    }


def f12_rows(timeout_s: float, real_engine: bool, options, names: Optional[List[str]] = None) -> List[Dict]:
    """The F12 rows of the selftest table (the MoRI stand-in, SGLang's default metadata path):

    * ``mori-aux-order``: ``ROW_REQUESTS`` requests with every metadata-row message 30 ms
      late; stock must report Success with a stale row (its signature), ``-ext`` every
      request Success with every byte verified;
    * ``mori-aux-short-row``: a 60-byte prefill row for decode's 64-byte row; stock
      Success with a stale tail, ``-ext`` Failed on both sides naming buffer, row and sizes;
    * ``mori-transfer-message-fault`` (every release): prefill's handling of decode's transfer
      message for room 1000 raises once; stock leaves the room to decode's waiting timeout,
      -ext fails it on both sides at once and serves room 1001.
    * ``mori-status-worker-fault``: decode's handling of room 1000's Success raises once; stock
      holds the room until the waiting timeout, ``-ext`` fails it at once, room 1001 served.

    "n/a" with the reason where F12 is not live, on the real engine (the rows need the
    stand-in's host copies and the test hooks), for non-default transfer options, or
    without a source checkout (the hooks live in ``test/support/``).
    """
    from sglang_disagg_ext.selftest.rows import make_row

    policy = releases.current_policy()
    engine = mori_rows.REAL_ENGINE_NOTE if real_engine else mori_rows.ENGINE_NOTE
    wanted = [n for n in ROW_NAMES if names is None or n in names]

    def row(name, stock, ext, verified, seconds, **extra):
        return make_row(name, FIX, mori_rows.BACKEND, stock, ext, verified, seconds, engine=engine, **extra)

    if not wanted:  # nothing selected: no stand-in self-check, no progress lines
        return []
    why = static_not_run_reason(policy, real_engine, options)
    if why is None:
        ok, detail = mori_rows.standin_usable()
        if not ok:
            why = f"stand-in unusable here: {detail}"
    if why:
        return [row(n, "n/a", "n/a", False, 0.0, detail=why) for n in wanted]

    rows = []
    legacy_why = release_not_run_reasons(policy)
    rows += [row(n, "n/a", "n/a", False, 0.0, detail=legacy_why[n]) for n in wanted if n in legacy_why]
    wanted = [n for n in wanted if n not in legacy_why]
    if "mori-aux-order" in wanted:
        start = time.monotonic()
        scn = aux_order(ROW_REQUESTS)
        stock = run(scn, "mori", "delay_aux_rows", timeout_s)
        ext = run(scn, "mori-ext", "delay_aux_rows", timeout_s)
        stale = sum(1 for r in stock.requests if stale_rows(r))
        ext_ok = ext.ok and all(r.bytes_verified and not r.mismatches for r in ext.requests)
        rows.append(row(
            scn.name, "fail" if stale or not stock.ok else "pass", "pass" if ext_ok else "fail",
            ext_ok and stale > 0, time.monotonic() - start,
            stock_expected="fail (Success with a stale metadata row)", stock_reproduced=stale > 0,
            stock_detail=f"{stale}/{len(stock.requests)} requests Success with a stale metadata row"
            if stale else stock.describe(logs=False),
            ext_detail=None if ext_ok else ext.describe(logs=False),
        ))
    if "mori-aux-short-row" in wanted:
        start = time.monotonic()
        scn = short_row()
        stock = run(scn, "mori", "shorter_aux_rows", timeout_s)
        ext = run(scn, "mori-ext", "shorter_aux_rows", timeout_s)
        reproduced = short_row_stock_signature(stock)
        ext_ok = short_row_failed_cleanly(ext)
        rows.append(row(
            scn.name, "fail" if reproduced or not stock.ok else "pass", "pass" if ext_ok else "fail",
            ext_ok and reproduced, time.monotonic() - start,
            stock_expected="fail (Success with 4 stale bytes)", stock_reproduced=reproduced,
            stock_detail=None if reproduced else stock.describe(logs=False),
            detail="-ext: Failed on both sides naming buffer, row and sizes; decode's rows untouched",
            ext_detail=None if ext_ok else ext.describe(logs=False),
        ))
    def fault_row(name, scenario, env, stock_signature, ext_handled, stock_expected, detail):
        """One thread-fault row: the same scenario and hook for stock and -ext, each judged by its signature."""
        from sglang_disagg_ext.selftest.harness.run import run_scenario

        start = time.monotonic()
        stock = run_scenario(scenario, "mori", timeout_s=timeout_s, extra_env=env)
        ext = run_scenario(scenario, "mori-ext", timeout_s=timeout_s, extra_env=env)
        reproduced, ext_ok = stock_signature(stock), ext_handled(ext)
        return row(
            name, "fail" if reproduced or not stock.ok else "pass", "pass" if ext_ok else "fail",
            ext_ok and reproduced, time.monotonic() - start,
            stock_expected=stock_expected, stock_reproduced=reproduced,
            stock_detail=None if reproduced else stock.describe(logs=False),
            detail=detail, ext_detail=None if ext_ok else ext.describe(logs=False),
        )

    if "mori-status-worker-fault" in wanted:
        rows.append(fault_row(
            "mori-status-worker-fault", status_fault(), status_fault_env(), status_fault_stock_signature,
            status_worker_survived, "fail (room held on decode until the waiting timeout)",
            "-ext: the room Failed on decode at once with the exception; the next room served"))
    if "mori-transfer-message-fault" in wanted:  # every release (F3's class carries it on 0.5.12.x)
        rows.append(fault_row(
            "mori-transfer-message-fault", transfer_fault(), transfer_fault_env(), transfer_fault_stock_signature,
            transfer_fault_handled, "fail (room held on decode until the waiting timeout, decode never told)",
            "-ext: the room Failed on prefill and decode at once with the exception; the next room served"))
    return rows


def rows(timeout_s: float = 240.0, real_engine: Optional[bool] = None, options=None,
         names: Optional[List[str]] = None) -> List[Dict]:
    """Every MoRI row of the selftest table (``backend_table``): F3's
    (``scenarios.mori.mori_rows``, same arguments), then F12's (:func:`f12_rows`)."""
    from sglang_disagg_ext.selftest.harness.transport import TransferOptions

    options = (options or TransferOptions()).validated()
    if real_engine is None:
        real_engine = os.environ.get(mori_rows.ENGINE_ENV, "").lower() == "real"
    out = mori_rows.mori_rows(timeout_s, real_engine=real_engine, options=options, names=names)
    return out + f12_rows(timeout_s, real_engine, options, names=names)
