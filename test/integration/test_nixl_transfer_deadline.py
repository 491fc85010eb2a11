"""F22: a NIXL transfer that never settles no longer holds prefill's transfer worker for ever.

Narrowest boundary: ``NixlKVManager._await_handles``, the wait each of prefill's transfer worker
threads makes on a room's posted batch (0.5.20-0.5.23), called here as the worker calls it. Real: a
NIXL agent with the UCX backend over TCP on loopback (this process, as prefill), a real WRITE of
256 MiB into a second process's registered host buffer (``test/support/nixl_peer.py``, as decode),
stopped with SIGSTOP (a stalled decode: the write then reads ``PROC`` for as long as it is stopped),
and the manager class the ``nixl-ext`` name routes. Stand-in: the manager is made without
``__init__`` (which binds the bootstrap sockets and starts the worker threads and a second agent);
it holds only ``agent``, the one attribute the wait reads. What the worker does with the wait's
"not settled" answer is stock's code, not run here (the room ends Failed on prefill with a reason,
decode is not told its pages are free, the worker takes its next room).

Stock: still waiting at 3x SGLang's waiting timeout (the worker and every room queued behind it
held); it returns only once the peer runs again. ``-ext``: "not settled" at the timeout; a healthy
write still settles and its bytes land.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("nixl")
torch = pytest.importorskip("torch")

from sglang_disagg_ext import releases  # noqa: E402
from support.nixl_peer import BUFFER_BYTES, NixlPeer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

POLICY = releases.current_policy()
_F22 = POLICY.fixes.get("F22")
# Sources carrying patches/<release>/'s F22 diff (`make test-patched`): the plugin installs nothing, and
# SGLang's own manager must do what -ext does on the unpatched wheel.
PATCHED = "F22" in POLICY.patched
needs_fix = pytest.mark.skipif(
    not (POLICY.is_live("F22") or PATCHED),
    reason=f"n/a: F22 is {getattr(_F22, 'value', _F22)!r} on SGLang {POLICY.version}",
)
DEADLINE_S = 2  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT (an integer for SGLang; 300 by default)
_names = iter(range(1_000_000))


@pytest.fixture(scope="module")
def peer():
    p = NixlPeer()
    yield p
    p.close()


@pytest.fixture
def prefill(peer, monkeypatch):
    """A prefill-side agent with a 256 MiB source of ones, the peer added; progress driven by the polls."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(DEADLINE_S))
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"prefill-{next(_names)}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    src = torch.ones(BUFFER_BYTES, dtype=torch.uint8)
    agent.register_memory(agent.get_reg_descs([(src.data_ptr(), src.numel(), 0, "")], "DRAM"))
    remote = agent.add_remote_agent(peer.metadata)
    assert peer.ask("zero") == 0

    def post():
        local = agent.get_xfer_descs([(src.data_ptr(), BUFFER_BYTES, 0)], "DRAM")
        far = agent.get_xfer_descs([(peer.ptr, BUFFER_BYTES, 0)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local, far, remote)
        assert agent.transfer(handle) != "ERR"
        return handle

    yield agent, post
    peer.cont()


def _manager(cls, agent):
    mgr = object.__new__(cls)
    mgr.agent = agent
    return mgr


def _wait_done(agent, handle, bound_s=60.0) -> str:
    stop = time.monotonic() + bound_s
    state = agent.check_xfer_state(handle)
    while state == "PROC" and time.monotonic() < stop:
        time.sleep(0.01)
        state = agent.check_xfer_state(handle)
    return state


@pytest.fixture
def stock_manager_class():
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    if PATCHED:
        pytest.skip("n/a: these sources carry patches/'s F22 diff; the ext tests run against them")
    if not hasattr(NixlKVManager, "_await_handles"):
        pytest.skip(f"n/a: SGLang {POLICY.version}'s NIXL workers wait inline (no _await_handles)")
    return NixlKVManager


@pytest.fixture
def ext_manager_class(clean_activation):
    from sglang.srt.disaggregation import nixl

    if PATCHED:
        return nixl.NixlKVManager
    clean_activation.activate("nixl-ext")
    from sglang_disagg_ext.backends.nixl.transfer_deadline import NixlTransferDeadlineMixin

    assert issubclass(nixl.NixlKVManager, NixlTransferDeadlineMixin)
    return nixl.NixlKVManager


@needs_fix
def test_stock_waits_on_a_stalled_decode_for_as_long_as_it_is_stalled(stock_manager_class, prefill, peer):
    agent, post = prefill
    mgr = _manager(stock_manager_class, agent)
    peer.stop()
    handle = post()
    answer = []
    waiter = threading.Thread(target=lambda: answer.append(mgr._await_handles([handle], failure_seen=False)),
                              daemon=True)
    waiter.start()
    waiter.join(3 * DEADLINE_S)
    # The bug: the worker thread is still in the wait at 3x SGLang's waiting timeout.
    assert waiter.is_alive() and answer == []
    peer.cont()
    waiter.join(60)
    assert answer == [(True, False)]  # it ends only because the peer ran again
    assert peer.ask("sum") == BUFFER_BYTES
    agent.release_xfer_handle(handle)


@needs_fix
def test_ext_gives_up_on_a_stalled_decode_at_the_waiting_timeout(ext_manager_class, prefill, peer, caplog):
    agent, post = prefill
    mgr = _manager(ext_manager_class, agent)
    peer.stop()
    handle = post()
    t0 = time.monotonic()
    answer = mgr._await_handles([handle], failure_seen=False)
    waited = time.monotonic() - t0
    assert answer == (False, True)  # not settled: stock's worker fails the room and takes its next one
    assert DEADLINE_S <= waited < DEADLINE_S + 2.0, waited
    assert ("NIXL transfer batch (1 handles) still running after 2s" if PATCHED
            else "F22: a NIXL transfer batch (1 handles) still running after 2 s") in caplog.text
    # The write was not cancelled: it lands once the peer runs (why decode is not told its pages are free).
    peer.cont()
    assert _wait_done(agent, handle) == "DONE"
    assert peer.ask("sum") == BUFFER_BYTES
    agent.release_xfer_handle(handle)


@needs_fix
def test_ext_still_waits_out_a_healthy_write(ext_manager_class, prefill, peer):
    agent, post = prefill
    mgr = _manager(ext_manager_class, agent)
    handle = post()
    assert mgr._await_handles([handle], failure_seen=False) == (True, False)
    assert peer.ask("sum") == BUFFER_BYTES  # every byte landed
    agent.release_xfer_handle(handle)
