"""F3 (MoRI per-component state) scenarios for ``sglang-disagg-ext selftest --backend mori``.

The engine boundary: AMD's ``mori`` package is ROCm-only and not on PyPI, so
these rows run SGLang's real MoRI backend (``MoriKVManager``/``Sender``/
``Receiver``, the real bootstrap server, both child processes of the transfer
harness) and the plugin's real code above it, with only the MoRI IO engine
replaced, at the ``mori.io`` / ``mori.cpp`` names SGLang imports, by the
in-repo stand-in ``test/support/mori_standin``. The stand-in really copies the
bytes of each write batch between the prefill and decode processes' registered
CPU buffers (``process_vm_writev``) and reports per-transfer status as MoRI
does. It is put on the children's ``PYTHONPATH`` only; it is never installed.
On an AMD node with the real ``mori`` installed, ``real_engine=True`` runs the
same scenarios against it (see ``docs/mori.md``).

Rows:

* ``mori-hybrid-state``: one request with a Mamba slot and SWA pages (and a
  second request where the Mamba component is missing on both sides). Stock
  ``mori`` on 0.5.12.x dies at PD bootstrap with ``struct.error``; ``mori-ext``
  moves every byte, sentinels untouched.
* ``mori-flat-decode-refused``: ``mori-ext`` prefill, stock ``mori`` decode
  (plain KV model, the only one stock 0.5.12.x MoRI can bootstrap): the prefill
  refuses the old-format registration and decode ends Failed with that reason,
  not a timeout.
* ``mori-flat-prefill-refused``: stock ``mori`` prefill, ``mori-ext`` decode:
  decode refuses to register and fails the request with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)

FIX = "F3"
BACKEND = "mori"
STRUCT_ERROR = "required argument is not an integer"
ENGINE_NOTE = (
    "MoRI IO engine = in-repo stand-in (test/support/mori_standin) at the mori.io / mori.cpp "
    "names SGLang imports: it copies each write batch between the prefill and decode processes' "
    "registered CPU buffers with process_vm_writev and reports per-transfer TransferStatus; "
    "bootstrap, registration, wire format and dispatch above it are SGLang's and the plugin's real code"
)
REAL_ENGINE_NOTE = "real AMD MoRI engine (mori.io imported from the installed package)"


# -- the stand-in ---------------------------------------------------------------------------


def _repo_root() -> str:
    """The folder that holds the ``sglang_disagg_ext`` package (a checkout or site-packages)."""
    import sglang_disagg_ext

    return os.path.dirname(os.path.dirname(os.path.abspath(sglang_disagg_ext.__file__)))


def standin_dir() -> Optional[str]:
    """``test/support/mori_standin`` of a source checkout, or ``None`` (installed wheel)."""
    path = os.path.join(_repo_root(), "test", "support", "mori_standin")
    return path if os.path.isfile(os.path.join(path, "mori", "cpp.py")) else None


def standin_env(aux_rdma: bool = True) -> Dict[str, str]:
    """``extra_env`` for ``run_scenario``: the stand-in and this checkout on the children's path.

    ``aux_rdma``: send metadata rows through the engine (see below); ``run``
    turns it off where both sides run ``mori-ext`` with F12 live.
    """
    path = standin_dir()
    if path is None:
        raise RuntimeError("the MoRI stand-in lives in a source checkout (test/support/mori_standin); none here")
    parts = [path, _repo_root()]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    env = {"PYTHONPATH": os.pathsep.join(parts)}
    if aux_rdma:
        # Aux rows through the engine (batch_write), not SGLang's default TCP
        # path: stock sends each aux buffer from a per-thread ZMQ socket and the
        # Success status from another, so decode can see Success before the last
        # aux rows land (seen with stock 0.5.23: rows of buffers 6-9 still
        # unwritten when decode polled Success). That race is F12 (live in every
        # release's stock MoRI, fixed by mori-ext on 0.5.23 only), not the
        # per-component state path F3 is about, and would make stock runs and
        # 0.5.12.x's mori-ext runs flaky.
        env["SGLANG_MORI_SEND_AUX_RDMA"] = "1"
    return env


def needs_aux_rdma(backend: str, decode_backend: Optional[str] = None) -> bool:
    """Whether a run must keep metadata rows off SGLang's racy TCP path: unless
    both sides run ``mori-ext`` where F12 is live (rows ordered with the status)."""
    both_ext = backend == "mori-ext" and decode_backend in (None, "mori-ext")
    return not (both_ext and releases.current_policy().is_live("F12"))


def standin_usable(timeout_s: float = 30.0) -> Tuple[bool, str]:
    """Whether the stand-in can copy between processes here, checked in a child process."""
    path = standin_dir()
    if path is None:
        return False, "no source checkout: test/support/mori_standin is not installed with the plugin"
    code = "from mori.cpp import standin_self_check as c; ok, d = c(); print(('OK ' if ok else 'NO ') + d)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"stand-in self-check did not run: {exc}"
    line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]
    return line.startswith("OK "), line[3:] if line[:3] in ("OK ", "NO ") else line


# -- scenarios (expected bytes come from harness.patterns, derived from these) -----------------


def _timeouts() -> Timeouts:
    return Timeouts(request_s=30.0, startup_s=150.0, sglang_waiting_s=8.0, sglang_bootstrap_s=8.0)


def hybrid_scenario() -> Scenario:
    """Two state components: a Mamba slot (2 layers x 2 tensors) and SWA pages.

    Request 0: Mamba slot 3 -> 6; SWA pages [2, 3, 5, 6, 7] -> [8, 9, 10, 4]
    (decode's window one page shorter: the first four pairs move, in three
    contiguous runs). Request 1: the Mamba component is missing on both sides
    (``None``: nothing moves, distinct from an empty list), SWA [1] -> [11].
    """
    return Scenario(
        name="mori-hybrid-state",
        kv=KVPoolSpec(num_pages=14),
        state_pools=[
            StatePoolSpec("mamba", num_pages=8, num_layers=2, mamba_item_bytes=[96, 32]),
            StatePoolSpec("swa", num_pages=12, num_layers=1),
        ],
        requests=[
            RequestSpec(
                src_kv_pages=[1, 2, 3, 4],
                dst_kv_pages=[6, 7, 9, 10],
                aux_index=2,
                dst_aux_index=5,
                state=[StateSpec("mamba", [3], [6]), StateSpec("swa", [2, 3, 5, 6, 7], [8, 9, 10, 4])],
            ),
            RequestSpec(
                src_kv_pages=[5],
                dst_kv_pages=[12],
                aux_index=1,
                dst_aux_index=3,
                state=[StateSpec("mamba", None, None), StateSpec("swa", [1], [11])],
            ),
        ],
        timeouts=_timeouts(),
    )


def kv_only_scenario(name: str) -> Scenario:
    """A plain KV model: the only kind stock 0.5.12.x MoRI can bootstrap."""
    return Scenario(
        name=name,
        kv=KVPoolSpec(num_pages=10),
        requests=[RequestSpec(src_kv_pages=[1, 2, 3], dst_kv_pages=[5, 6, 7], aux_index=1, dst_aux_index=4)],
        timeouts=_timeouts(),
    )


# -- running and judging ---------------------------------------------------------------------------


def run(scenario: Scenario, backend: str, decode_backend: Optional[str] = None, timeout_s: float = 240.0,
        real_engine: bool = False, device: str = "cpu", ib_device: Optional[str] = None, protocol: str = "tcp"):
    """One harness run with the stand-in on the children's path (unless ``real_engine``).

    ``device``/``ib_device`` apply to the real engine only (SGLang passes the
    IB device to MoRI as ``MORI_RDMA_DEVICES``); the stand-in copies host memory.
    MoRI has no protocol choice (SGLang configures its RDMA backend):
    ``protocol`` only travels along for the record.
    """
    from sglang_disagg_ext.selftest.harness.run import run_scenario

    extra = None if real_engine else standin_env(aux_rdma=needs_aux_rdma(backend, decode_backend))
    return run_scenario(
        scenario, backend, timeout_s=timeout_s, extra_env=extra, decode_backend=decode_backend,
        device=device, ib_device=ib_device, protocol=protocol,
    )


def _texts(res) -> str:
    parts = [res.error or "", res.prefill_log_tail, res.decode_log_tail]
    for r in res.requests:
        parts += [r.error or "", r.prefill_failure_reason or "", r.decode_failure_reason or ""]
        parts += r.prefill_log + r.decode_log
    return "\n".join(parts)


def stock_struct_error(res) -> bool:
    """Stock 0.5.12.x MoRI on a hybrid model: decode dies at bootstrap with the struct error."""
    return not res.ok and STRUCT_ERROR in _texts(res)


def refused_cleanly(res, side: str) -> bool:
    """Every request ended Failed on the refusing side with a 'refused ... at registration' reason,
    decode (the side users wait on) was told so instead of timing out, and no byte moved."""
    if not res.requests:
        return False
    for r in res.requests:
        reason = (r.decode_failure_reason or "") + " " + (r.prefill_failure_reason or "")
        if r.decode_status != "Failed" or "refused" not in reason or "at registration" not in reason:
            return False
        if "timed out" in (r.decode_failure_reason or ""):
            return False
        if side == "prefill" and r.prefill_status != "Failed":
            return False
        if not nothing_written(r):
            return False
    return True


def nothing_written(request_result) -> bool:
    """Decode's pools hold only the sentinel: every expected write is missing and no
    other page was touched."""
    return all(
        "must be untouched" not in m and ("found the sentinel" in m or "more mismatching" in m)
        for m in request_result.mismatches
    )


def _row(scenario: str, stock: str, ext: str, verified: bool, seconds: float, engine: str, **extra) -> Dict:
    from sglang_disagg_ext.selftest.rows import make_row

    return make_row(scenario, FIX, BACKEND, stock, ext, verified, seconds, engine=engine, **extra)


ROW_NAMES = ("mori-hybrid-state", "mori-flat-decode-refused", "mori-flat-prefill-refused")


# Set to "real" on an AMD node with AMD's mori installed to run the rows on it.
ENGINE_ENV = "SGLANG_DISAGG_EXT_MORI_ENGINE"


def mori_rows(timeout_s: float = 240.0, real_engine: Optional[bool] = None, options=None,
              names: Optional[List[str]] = None) -> List[Dict]:
    """The F3 rows of the selftest table (see the module docstring).

    ``real_engine``: use the installed ``mori`` instead of the stand-in;
    default from ``$SGLANG_DISAGG_EXT_MORI_ENGINE`` (``real``). ``options``
    (``TransferOptions``): the stand-in copies host memory between processes
    and has no transports, so anything but CPU pools over the default protocol
    makes its rows "n/a" with the reason; the real engine gets the device and
    IB device. ``names`` limits the rows.
    """
    from sglang_disagg_ext.selftest.harness.transport import TransferOptions

    options = (options or TransferOptions()).validated()
    if real_engine is None:
        real_engine = os.environ.get(ENGINE_ENV, "").lower() == "real"
    # Only the rows asked for are built: an unselected row neither runs nor prints progress.
    wanted = [n for n in ROW_NAMES if names is None or n in names]
    return _mori_rows(timeout_s, real_engine, options, wanted) if wanted else []


def not_run_reasons(policy, real_engine: bool, options) -> Dict[str, Optional[str]]:
    """Why each F3 row is "n/a" here, from the release and options alone (``None``: it runs).

    Shared by the rows and ``selftest --list``; the stand-in's self-check (a child
    process) is left to the run.
    """
    why = None
    if not real_engine and not options.is_default:
        why = (
            f"asked for {options.describe()}: the MoRI stand-in engine copies host memory between processes "
            "and has no transports to choose; these options apply to the real engine only "
            f"({ENGINE_ENV}=real on a ROCm node with mori installed)"
        )
    elif policy.fixes.get(FIX) is releases.FixStatus.NA or not policy.supported:
        why = f"F3 is n/a on SGLang {policy.version}: MoRI has no hybrid-state path before 0.5.12"
    elif not real_engine and standin_dir() is None:
        why = "stand-in unusable here: no source checkout: test/support/mori_standin is not installed with the plugin"
    out: Dict[str, Optional[str]] = {name: why for name in ROW_NAMES}
    if why is None and policy.fixes.get(FIX) is not releases.FixStatus.LIVE:
        # The refusals are the plugin's wire; on this release mori-ext is the stock classes.
        for name in ROW_NAMES[1:]:
            out[name] = f"F3 is upstream on SGLang {policy.version}: mori-ext uses the stock classes and stock wire"
    return out


def _mori_rows(timeout_s: float, real_engine: bool, options, wanted: List[str]) -> List[Dict]:
    policy = releases.current_policy()
    engine = REAL_ENGINE_NOTE if real_engine else ENGINE_NOTE
    reasons = not_run_reasons(policy, real_engine, options)
    if reasons[ROW_NAMES[0]] is None and not real_engine:
        ok, detail = standin_usable()
        if not ok:
            reasons = {name: f"stand-in unusable here: {detail}" for name in ROW_NAMES}
    if reasons[ROW_NAMES[0]] is not None:
        return [_row(name, "n/a", "n/a", False, 0.0, engine, detail=reasons[name]) for name in wanted]
    transfer = {"device": options.device, "ib_device": options.ib_device, "protocol": options.protocol}
    status = policy.fixes.get(FIX)

    rows = []
    if ROW_NAMES[0] in wanted:
        rows.append(_hybrid_row(policy, status, engine, timeout_s, real_engine, transfer))
    if status is not releases.FixStatus.LIVE:
        rows += [_row(name, "n/a", "n/a", False, 0.0, engine, detail=reasons[name])
                 for name in ROW_NAMES[1:] if name in wanted]
        return rows

    for name, prefill, decode, side in (
        ("mori-flat-decode-refused", "mori-ext", "mori", "prefill"),
        ("mori-flat-prefill-refused", "mori", "mori-ext", "decode"),
    ):
        if name not in wanted:
            continue
        start = time.monotonic()
        res = run(kv_only_scenario(name), prefill, decode_backend=decode, timeout_s=timeout_s,
                  real_engine=real_engine, **transfer)
        passed = refused_cleanly(res, side)
        rows.append(_row(
            # verified: decode's pools were compared byte for byte and are untouched.
            name, "n/a", "pass" if passed else "fail", passed, time.monotonic() - start, engine,
            detail=f"prefill {prefill}, decode {decode}: refused at registration, decode pools untouched",
            ext_detail=None if passed else res.describe(logs=False),
        ))
    return rows


def _hybrid_row(policy, status, engine: str, timeout_s: float, real_engine: bool, transfer) -> Dict:
    """The ``mori-hybrid-state`` row: the hybrid scenario stock and -ext."""
    start = time.monotonic()
    scn = hybrid_scenario()
    stock = run(scn, "mori", timeout_s=timeout_s, real_engine=real_engine, **transfer)
    ext = run(scn, "mori-ext", timeout_s=timeout_s, real_engine=real_engine, **transfer)
    live = status is releases.FixStatus.LIVE
    return _row(
        scn.name,
        "pass" if stock.ok else "fail",
        "pass" if ext.ok else "fail",
        ext.ok and all(r.bytes_verified for r in ext.requests),
        time.monotonic() - start,
        engine,
        stock_expected="fail (struct.error at bootstrap)" if live else "pass (upstream fix)",
        stock_detail=(
            "struct.error at PD bootstrap" if stock_struct_error(stock) else None if stock.ok
            else stock.describe(logs=False)
        ),
        ext_detail=None if ext.ok else ext.describe(logs=False),
    )
