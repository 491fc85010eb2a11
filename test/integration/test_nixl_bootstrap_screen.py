"""F15 on real NIXL (UCX over 127.0.0.1), every release 0.5.10.post1-0.5.23: stock ``nixl`` vs ``nixl-ext``.

Prefill TP 1 -> decode TP 1, rooms 1000 and 1001. Before any decode registers, four messages
arrive on prefill's bootstrap socket from a PUSH socket of the test's, one of each kind stock's
loop dies of (``test/support/prefill_faults.py::BAD_BOOTSTRAP_MESSAGES``: traffic whose first
frame is not SGLang's NIXL guard, a guarded message of two frames, a room frame that is not an
integer, a registration its parser cannot read). Then the two requests run.

Stock (every release: no per-message handler, 0.5.10.post1 nixl/conn.py:858-876 ... 0.5.23
:3379-3395): the first message ends the bootstrap thread (0.5.21+ log it first,
``bootstrap_thread_guarded``); decode's registration and both requests are never read, so decode
ends each room by its waiting timeout and prefill's rooms stay Bootstrapping (up to 0.5.17, no
bootstrap deadline in NIXL's sender) or time out there (0.5.18+).
``nixl-ext``: the four are dropped and counted by kind in ``bootstrap_messages_dropped_total``;
both rooms Success, every destination byte checked, every other page untouched, no thread died.

On sources carrying ``patches/0.5.23``'s F15 diff (``make test-patched``) stock's thread must survive
and serve both requests (the diff drops each message with an error; it keeps no counter), and
``-ext``, which then installs nothing for F15, the same.

The one replacement, as in every NIXL test here: both sides register host memory through the
harness's shim (``harness/nixl_shim.py``; UCX here has no CUDA support). The messages come from
the hook ``send_bad_bootstrap_messages`` in the prefill process, right after the manager exists.
"""

import dataclasses
import os
import re

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios import nixl_newest as N
from support import plugin_metrics
from support.prefill_faults import BAD_BOOTSTRAP_MESSAGES

# Sources carrying patches/<release>/'s F15 diff: SGLang's own loop drops the messages.
PATCHED = "F15" in releases.current_policy().patched

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not (releases.current_policy().is_live("F15") or PATCHED),
                       reason="F15 is not live on this release"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]

FAULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "prefill_faults.py")
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
RUN_BOUND_S = 240  # one run: startup, two requests (stock: each up to SGLang's waiting timeout), teardown


def _ext_manager(policy) -> str:
    """The ``nixl-ext`` manager per release, written out by hand (``backends/nixl/conn.ext_classes``)."""
    if policy.is_live("F11"):
        return "sglang_disagg_ext.backends.nixl.head_sliced.NixlHeadSlicedKVManager"
    if policy.is_live("F13"):
        return "sglang_disagg_ext.backends.nixl.swa_tp.NixlSwaTpKVManager"
    return "sglang_disagg_ext.backends.nixl.conn.NixlExtKVManager"


def _timed_out(reason, state: str) -> bool:
    m = re.search(rf"timed out after (\d+\.\d)s in KVPoll\.{state}\b", reason or "")
    return m is not None and float(m.group(1)) >= N.TIMEOUTS.sglang_waiting_s


def _run(backend: str):
    scenario = dataclasses.replace(N.registration_fault(), name="nixl bad bootstrap messages tp1->tp1", decode_tp=1)
    env = {nixl_shim.ENV: "1", "SGLANG_HARNESS_PREFILL_HOOK": f"{FAULTS}:send_bad_bootstrap_messages"}
    return run_scenario(scenario, backend, extra_env=env)


def _assert_served(result):
    for r in result.requests:
        assert r.ok and r.bytes_verified and r.rank_status == {"prefill": "Success", "decode": "Success"}, (
            result.describe())
    assert result.thread_errors == {"prefill": [], "decode": []}, result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
def test_stock_bootstrap_thread_dies_of_a_bad_message():
    stock = _run("nixl")
    assert stock.prefill_manager == STOCK_MANAGER, stock.describe()
    if PATCHED:
        _assert_served(stock)
        return
    # The thread died at the hook, before either request started: the worker's list, not a request's.
    died = re.compile(r"^thread \S+ \(bootstrap_thread(_guarded)?\): AssertionError: First message should be")
    assert any(died.search(t) for t in stock.thread_errors["prefill"]), (stock.thread_errors, stock.describe())
    deadline = releases.features().stock_nixl_sender_bootstrap_deadline
    for r in stock.requests:
        assert r.rank_status == {"prefill": "Failed" if deadline else "Bootstrapping", "decode": "Failed"}, (
            stock.describe())
        if deadline:
            assert _timed_out(r.prefill_failure_reason, "Bootstrapping"), stock.describe()
        assert _timed_out(r.decode_failure_reason, "WaitingForInput"), stock.describe()


@pytest.mark.timeout(RUN_BOUND_S)
def test_ext_drops_each_bad_message_and_serves_every_request():
    ext = _run("nixl-ext")
    _assert_served(ext)
    if PATCHED:
        return  # the plugin installs nothing for F15 there: no drop counter
    assert ext.prefill_manager == _ext_manager(releases.current_policy()), ext.describe()
    text = ext.plugin_metrics["prefill"]
    for kind, _ in BAD_BOOTSTRAP_MESSAGES:
        assert plugin_metrics.value(text, "sglang_disagg_ext_bootstrap_messages_dropped_total",
                                    backend="nixl", reason=kind) == 1.0, (kind, text)
