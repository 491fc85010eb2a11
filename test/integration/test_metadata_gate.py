"""F10: decode's metadata gate gets a deadline. Stock vs ext on SGLang's own decode queue, CPU.

Narrowest boundary: ``sglang.srt.disaggregation.utils._apply_metadata_gate``,
the function SGLang's ``poll_and_all_reduce`` looks up on every poll; the ext
runs replace exactly that module attribute (``backends.common.metadata_gate``), stock
runs leave it alone. It is driven through SGLang's real
``DecodeTransferQueue.pop_transferred`` (``selftest/scenarios/metadata_gate.py``
lists what is real: receiver, status handler, ``MetadataBuffers``, allocator,
``Req``/``DecodeRequest``, the queue's Failed and commit paths, a one-rank gloo
group) with the metadata row never written. Minimal stand-ins, for what needs
a running server: the manager's and queue's ``__init__`` (their attributes are
set as ``__init__`` sets them), the scheduler (five fields), the tree cache's
``unlock`` and ``_release_request`` (records the call instead of freeing KV
pages through a tree cache). The deadline is SGLang's own waiting timeout,
set to 1 s through ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``.

A full two-process harness scenario is not used: the harness's decode worker
polls the receiver itself and has no transfer queue, so SGLang's gate never
runs there; adding a queue to it would mean more stand-ins, not fewer.

F10 is live on every release; its queue differs per release (0.5.13-0.5.18
pass ``server_args`` to the gate, releases before 0.5.20 handle prefill's status
inline, before 0.5.22 the KV pages are released through ``release_kv_cache``):
the scenario module says which stand-in covers which. Up to 0.5.12.post1 there
is no gate function: stock holds the request in
``DecodeTransferQueue._commit_transfer_to_req``, after the all-reduce, and the
plugin installs 0.5.13's gate with the deadline before it, through the decode
module's ``poll_and_all_reduce`` while the transfer queue's ``pop_transferred``
runs (``backends/common/metadata_gate.py``); the boundary there is that name.
"""

import gc
import re
import types

import pytest

torch = pytest.importorskip("torch")

from sglang_disagg_ext import releases  # noqa: E402
from sglang_disagg_ext.backends.common import metadata_gate  # noqa: E402
from sglang_disagg_ext.selftest.scenarios import metadata_gate as scenario  # noqa: E402

POLICY = releases.current_policy()
LIVE = POLICY.is_live("F10")
_F10 = POLICY.fixes.get("F10")
# Sources carrying patches/<release>/'s F10 diff (`make test-patched`): SGLang's own gate has the
# deadline, the plugin installs none, and stock must do what -ext does on the unpatched wheel.
PATCHED = "F10" in POLICY.patched
needs_live = pytest.mark.skipif(
    not LIVE,
    reason=("n/a: these sources carry patches/'s F10 diff, so the plugin installs no gate (the patched tests run)"
            if PATCHED else
            f"n/a: F10 is {getattr(_F10, 'value', _F10)!r} on SGLang {POLICY.version}; the plugin installs no gate here"),
)
needs_gate = pytest.mark.skipif(
    not (LIVE or PATCHED),
    reason=f"n/a: F10 is {getattr(_F10, 'value', _F10)!r} on SGLang {POLICY.version} and not patched in",
)

# Read by hand in each wheel: does disaggregation/utils.py define _apply_metadata_gate?
GATE_IN_UTILS = {
    "0.5.10.post1": False,  # decode.py:979 `elif actual_room == 0: return False` in _commit_transfer_to_req
    "0.5.11": False,  # decode.py:1205
    "0.5.12": False,
    "0.5.12.post1": False,  # decode.py:1412-1415
    # 0.5.13-0.5.18: a fourth argument, server_args (fake-transfer check); 0.5.19+: three.
    "0.5.13": True,  # utils.py:78
    "0.5.14": True,  # utils.py:78
    "0.5.15": True,  # utils.py:103
    "0.5.16": True,  # utils.py:111
    "0.5.17": True,  # utils.py:143
    "0.5.18": True,  # utils.py:187
    "0.5.19": True,  # utils.py:180
    "0.5.20": True,  # utils.py:212
    "0.5.21": True,  # utils.py:173
    "0.5.22": True,  # utils.py:244
    "0.5.23": True,  # utils.py:245-260, called by poll_and_all_reduce (:316) and ..._with_staging (:367)
}
DEADLINE = scenario.DEADLINE_S


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    yield
    metadata_gate.uninstall_metadata_gate_deadline()


@needs_live
@pytest.mark.timeout(240)
def test_stock_holds_a_request_whose_metadata_never_lands():
    """The live bug: 5 deadlines after Success the request is still held, nothing ended."""
    r = scenario.gate_scenario(ext=False, case="lost")
    assert r.error is None, r.describe()
    assert r.outcome == "queued" and r.seconds >= scenario.STOCK_BOUND_FACTOR * DEADLINE, r.describe()
    assert r.receiver_poll == "Success"  # the receiver froze its conclusion
    assert r.gate_poll == "Transferring"  # ... and the gate keeps turning it back
    assert r.row_room == 0
    assert r.abort_message is None and r.released == 0 and r.streamed == 0 and not r.slot_freed
    assert r.others_unchanged
    assert scenario.stock_lost_signature(r) is None


@pytest.mark.skipif(not PATCHED, reason="n/a: these SGLang sources do not carry patches/'s F10 diff")
@pytest.mark.timeout(240)
def test_patched_sglang_fails_the_request_at_the_deadline_with_the_reason():
    """patches/<release>/'s F10 diff in SGLang's own gate: stock ends the request as -ext does
    on the unpatched wheel (Failed by the deadline through the queue's Failed path, the
    reason in the abort message, KV released once, slot freed, no other row touched)."""
    assert not metadata_gate.installed()
    r = scenario.gate_scenario(ext=False, case="lost")
    assert r.error is None, r.describe()
    assert scenario.ext_lost_problem(r) is None, r.describe()
    assert "metadata buffer index 2 of 4 still shows no room" in r.abort_message
    assert r.room_left_in == [] and r.others_unchanged


@needs_live
@pytest.mark.timeout(240)
def test_ext_fails_the_request_at_the_deadline_with_the_reason():
    r = scenario.gate_scenario(ext=True, case="lost")
    assert r.error is None, r.describe()
    assert r.outcome == "failed", r.describe()
    assert DEADLINE <= r.seconds <= DEADLINE + scenario.EXT_MARGIN_S, r.describe()
    msg = r.abort_message
    # Built by the queue's own Failed branch from the receiver's failure_exception().
    assert msg.startswith("Decode transfer failed for request rank=0 "), msg
    assert f"KVTransferError(bootstrap_room={scenario.ROOM}): decode metadata gate: " in msg
    assert f"room {scenario.ROOM}'s KV transfer reported Success but its metadata never landed" in msg
    assert r.metadata_index == 2  # the third slot: two other requests hold slots 0 and 1
    assert "metadata buffer index 2 of 4 still shows no room" in msg
    waited = float(re.search(r"no room after (\d+\.\d)s", msg).group(1))
    assert DEADLINE <= waited <= DEADLINE + scenario.EXT_MARGIN_S
    assert "(deadline 1s, SGLANG_DISAGGREGATION_WAITING_TIMEOUT)" in msg
    # Ended once, its KV released once, its metadata slot back in the allocator,
    # nothing left for a later request reusing the room, no other row touched.
    assert (r.released, r.streamed, r.slot_freed) == (1, 1, True)
    assert r.room_left_in == []
    assert r.others_unchanged
    gc.collect()
    assert len(metadata_gate._clock) == 0  # the hold went with the receiver


@needs_gate
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ext", [False, True], ids=["stock", "ext"])
def test_metadata_landing_after_a_slow_transfer_is_committed(ext):
    """Queued 1.2 deadlines before Success, row lands 0.6 deadlines after: never cut short."""
    r = scenario.gate_scenario(ext=ext, case="landed")
    assert r.error is None, r.describe()
    assert r.outcome == "transferred", r.describe()
    assert r.committed_output_ids == [scenario.TOKEN]  # the landing row's token, by _commit_transfer_to_req
    assert r.abort_message is None and r.released == 0
    assert r.slot_freed and r.room_left_in == [] and r.others_unchanged


def _gate_inputs():
    """Seven queued requests, one per case the gate can see, on rows 0-6 of an 8-row MetadataBuffers.

    Each receiver's room is put in its state through the manager's own
    ``update_status``; the receivers are then polled by SGLang.
    """
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_disagg_ext.selftest.scenarios.f5 import _meta_req

    buffers = scenario.build_metadata_buffers(rows=8, hidden_size=16)
    mgr = scenario._manager(0)
    states = [KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
              KVPoll.Success, KVPoll.Success, KVPoll.Success]
    reqs = []
    for i, state in enumerate(states):
        room = 9000 + i
        host = FAKE_BOOTSTRAP_HOST if i == 6 else "127.0.0.1"  # request 6: a fake transfer
        req = Req(f"g{i}", "", [1], SamplingParams(max_new_tokens=2), bootstrap_host=host, bootstrap_port=1,
                  bootstrap_room=room)
        receiver = MooncakeKVReceiver(mgr, "127.0.0.1:1", room)  # room Bootstrapping
        if state != KVPoll.Bootstrapping:
            mgr.update_status(room, state)
        reqs.append(DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=i))
    buffers.set_buf(_meta_req(4, 11, 16, 9004))  # only request 4's row has landed
    return reqs, buffers, mgr


@needs_gate
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "ext, timeout_s, expected",
    [
        # F=0 B=1 W=2 T=3 S=4, by hand: only a Success whose row shows room 0 (request 5) is
        # held; the fake transfer (6) and the landed row (4) pass; nothing else is touched.
        (False, 0, [0, 1, 2, 3, 4, 3, 4]),
        (True, 0, [0, 1, 2, 3, 4, 0, 4]),  # timeout 0: failed when first held, as SGLang's own
        (True, 100, [0, 1, 2, 3, 4, 3, 4]),  # within the deadline: exactly stock
    ],
    ids=["stock", "ext-expired", "ext-within"],
)
def test_gate_changes_only_a_held_success_past_its_deadline(ext, timeout_s, expected):
    from sglang.srt.disaggregation import utils

    if PATCHED:
        if ext:
            pytest.skip("n/a on patched sources: the plugin installs no gate (SGLang's own has the deadline)")
        expected = [0, 1, 2, 3, 4, 0, 4]  # SGLang's patched gate at timeout 0: as ext-expired

    reqs, buffers, mgr = _gate_inputs()
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="mooncake")
    with scenario.waiting_timeout(timeout_s), metadata_gate.metadata_gate_deadline(enabled=ext):
        if releases.features().metadata_gate_function:
            # What DecodeTransferQueue._poll_with_metadata_gate calls; one rank, so no reduction.
            extra = {}
            if releases.features().metadata_gate_needs_server_args:  # 0.5.13-0.5.18
                extra["server_args"] = server_args
            polls = utils.poll_and_all_reduce([r.kv_receiver for r in reqs], scenario._one_rank_group(),
                                              decode_reqs=reqs, metadata_buffers=buffers, **extra)
        else:
            # Up to 0.5.12.x: what pop_transferred calls (the decode module's name), while the
            # queue is marked as polling (what the plugin's pop_transferred wrapper does).
            # Stock has no gate before the all-reduce: request 5's Success goes through
            # (its _commit_transfer_to_req holds it afterwards).
            from sglang.srt.disaggregation import decode

            if not ext:
                expected = [0, 1, 2, 3, 4, 4, 4]
            queue = types.SimpleNamespace(queue=reqs, metadata_buffers=buffers,
                                          scheduler=types.SimpleNamespace(server_args=server_args))
            token = metadata_gate._polling_queue.set(queue)
            try:
                polls = decode.poll_and_all_reduce([r.kv_receiver for r in reqs], scenario._one_rank_group())
            finally:
                metadata_gate._polling_queue.reset(token)
    assert polls == expected
    if expected[5] == 0:
        assert list(mgr.failure_records) == [9005]
        reason = mgr.failure_records[9005]
        assert reason.startswith("decode metadata gate: room 9005's KV transfer reported Success"), reason
        assert "metadata buffer index 5 of 8 still shows no room after 0.0s (deadline 0s," in reason
    else:
        assert mgr.failure_records == {}


@needs_live
@pytest.mark.timeout(120)
def test_install_is_idempotent_and_uninstall_restores_stock():
    """0.5.13+: the gate function is replaced; up to 0.5.12.x (no gate function, hand-read in
    GATE_IN_UTILS) the decode module's poll_and_all_reduce and the transfer queue's
    pop_transferred are."""
    from sglang.srt.disaggregation import decode, utils

    if POLICY.version not in GATE_IN_UTILS:
        pytest.skip(f"n/a: no hand-read gate fact for SGLang {POLICY.version}")
    assert releases.features().metadata_gate_function is GATE_IN_UTILS[POLICY.version]

    def hooks():
        if GATE_IN_UTILS[POLICY.version]:
            return (utils._apply_metadata_gate,)
        return (decode.poll_and_all_reduce, decode.DecodeTransferQueue.pop_transferred)

    stock = hooks()
    if GATE_IN_UTILS[POLICY.version]:
        hooked = ["sglang.srt.disaggregation.utils._apply_metadata_gate"]
        ours = (metadata_gate.gate_with_deadline,)
    else:
        hooked = ["sglang.srt.disaggregation.decode.poll_and_all_reduce",
                  "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred"]
        ours = (metadata_gate.poll_and_all_reduce_gated, metadata_gate.pop_transferred_marked)
    assert not metadata_gate.installed()
    assert metadata_gate.install_metadata_gate_deadline() == hooked
    assert metadata_gate.install_metadata_gate_deadline() == hooked
    assert metadata_gate.installed() and hooks() == ours
    metadata_gate.uninstall_metadata_gate_deadline()
    assert hooks() == stock and not metadata_gate.installed()
    metadata_gate.uninstall_metadata_gate_deadline()  # nothing installed: a no-op
    assert hooks() == stock
    with metadata_gate.metadata_gate_deadline(enabled=True):
        assert metadata_gate.installed()
    assert hooks() == stock


@pytest.mark.timeout(300)
def test_selftest_rows():
    rows = scenario.metadata_gate_rows()
    assert [r["scenario"] for r in rows] == scenario.metadata_gate_row_names()
    if not LIVE:
        assert all(r["stock"] == "n/a" and r["ext"] == "n/a" and "F10" in r["not_run"] for r in rows)
        return
    assert [(r["stock"], r["ext"], r["verified"]) for r in rows] == [("fail", "pass", True), ("pass", "pass", True)], rows
