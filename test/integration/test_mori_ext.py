"""mori-ext (F3): per-component hybrid state on SGLang's real MoRI backend.

The engine boundary. AMD's ``mori`` is ROCm-only and not on PyPI. These tests
run SGLang's real MoRI code -- ``MoriKVManager``/``MoriKVSender``/
``MoriKVReceiver``, the real bootstrap server, registration, the wire format
and per-component dispatch, in two child processes of the transfer harness for
the engine tests -- with only the MoRI IO engine replaced, at its narrowest
boundary (the ``mori.io`` / ``mori.cpp`` names SGLang's ``mori/conn.py``
imports), by ``test/support/mori_standin``: an engine that really copies the
bytes of each write batch between the registered CPU buffers of the prefill and
decode processes (``process_vm_writev`` on the peer pid from its
``EngineDesc``) and reports one ``TransferStatus`` per transfer the way MoRI
does. The stand-in reaches the children through ``PYTHONPATH`` only, and the
in-process tests put it on ``sys.path`` for their duration only. Expected
bytes come from ``harness/patterns.py`` (derived from the scenario), never from
the code under test.

On releases where F3 is not live the tests assert what applies there: n/a
before 0.5.12 (no MoRI state path), upstream from 0.5.13 (``mori-ext`` is the
stock classes, and the same two-component scenario passes through them).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import struct
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import require_or_skip

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.scenarios import mori as selftest_mori
from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.harness.scenario import STATE_POOL_BASE

POLICY = releases.current_policy()
F3 = POLICY.fixes.get("F3")
LIVE = F3 is releases.FixStatus.LIVE
STANDIN = selftest_mori.standin_dir()
RUN_TIMEOUT = 240

STOCK_MANAGER = "sglang.srt.disaggregation.mori.conn.MoriKVManager"
EXT_MANAGER = "sglang_disagg_ext.backends.mori.conn.MoriExtKVManager"
F12_MANAGER = "sglang_disagg_ext.backends.mori.metadata_order.MoriOrderedKVManager"


# -- helpers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def standin_modules():
    """The stand-in importable in this process for the module's tests, then gone again."""
    assert STANDIN is not None, "test/support/mori_standin is missing from the checkout"
    sys.path.insert(0, STANDIN)
    importlib.invalidate_caches()
    try:
        import mori.cpp
        import mori.io  # noqa: F401

        assert getattr(sys.modules["mori"], "STANDIN", False), "a real mori shadows the stand-in"
        yield mori.cpp
    finally:
        sys.path.remove(STANDIN)
        for name in list(sys.modules):
            if (
                name == "mori"
                or name.startswith("mori.")
                or name.startswith("sglang.srt.disaggregation.mori")
                or name == "sglang_disagg_ext.backends.mori.conn"
            ):
                del sys.modules[name]
        for parent, attr in (("sglang.srt.disaggregation", "mori"), ("sglang_disagg_ext.backends", "mori")):
            if parent in sys.modules and hasattr(sys.modules[parent], attr):
                delattr(sys.modules[parent], attr)
        importlib.invalidate_caches()


@pytest.fixture(scope="module")
def ext(standin_modules):
    from sglang_disagg_ext.backends.mori import conn as ext_module

    return ext_module


def _standin_or_skip():
    ok, detail = selftest_mori.standin_usable()
    require_or_skip("the MoRI stand-in (test/support/mori_standin)", ok, f"cannot copy between processes here: {detail}")


def _assert_ok(res):
    assert res.ok, res.describe()
    for r in res.requests:
        assert r.prefill_status == "Success" and r.decode_status == "Success", res.describe()
        assert r.bytes_verified and r.mismatches == [], res.describe()


class _Socket:
    def __init__(self):
        self.sent = []

    def send_multipart(self, frames):
        self.sent.append(list(frames))


def _receiver(cls, mgr):
    """A receiver object wired to a capturing socket (its messages are what we test)."""
    rcv = object.__new__(cls)
    rcv.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": 1, "is_dummy": False}]
    rcv.bootstrap_room = 77
    rcv.required_dst_info_num = 1
    rcv.kv_mgr = mgr
    sock, lock = _Socket(), threading.Lock()
    rcv._connect_to_bootstrap_server = lambda info: (sock, lock)
    return rcv, sock


def _decode_side(cpp, state_item_lens, state_lens_bytes, dims):
    """A decode manager's registration-relevant state, with buffers registered in a real stand-in engine."""
    from mori.io import IOEngine, IOEngineConfig, MemoryLocationType

    engine = IOEngine("decode-test", IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(cpp.BackendType.RDMA, cpp.RdmaBackendConfig())
    keep = []

    def reg(n, loc=MemoryLocationType.GPU):
        buf = ctypes.create_string_buffer(n)
        keep.append(buf)
        return engine.register_memory(ctypes.addressof(buf), n, 0, loc)

    state_descs = [[None if n == 0 else reg(n) for n in comp] for comp in state_lens_bytes]
    kv_args = SimpleNamespace(
        state_item_lens=state_item_lens, state_dim_per_tensor=dims, gpu_id=0, engine_rank=0, kv_item_lens=[256],
        aux_item_lens=[64],
    )
    mgr = SimpleNamespace(
        kv_args=kv_args,
        state_mem_descs=state_descs,
        kv_mem_descs=[reg(1024), reg(1024)],
        aux_mem_descs=[reg(64, MemoryLocationType.CPU)],
        engine_desc=engine.get_engine_desc(),
        local_ip="127.0.0.1",
        rank_port=4242,
        attn_tp_size=1,
        _keep=keep,
    )
    return mgr


# -- release facts -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_f3_status_matches_the_release_table():
    version = POLICY.version
    if version in ("0.5.12", "0.5.12.post1"):
        # Sources carrying patches/<release>/ have the fix, like a later release.
        expected = releases.FixStatus.UPSTREAM if "F3" in POLICY.patched else releases.FixStatus.LIVE
        assert F3 is expected
        assert POLICY.layout is releases.StateLayout.PER_COMPONENT
    elif version in ("0.5.10.post1", "0.5.11"):
        assert F3 is releases.FixStatus.NA  # MoRI has no hybrid-state send before 0.5.12
    else:
        # Upstream from 0.5.13; mori-ext still routes where F12 (metadata order) is live.
        assert F3 is releases.FixStatus.UPSTREAM
        assert POLICY.routes("mori") == POLICY.is_live("F12")
    assert releases.EXT_BACKENDS["mori-ext"] == "mori"


@pytest.mark.timeout(300)
def test_doctor_does_not_see_the_standin():
    """`sglang-disagg-ext doctor` keeps reporting mori as not importable: the stand-in is never installed."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "sglang_disagg_ext.cli", "doctor", "--json"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    engines = json.loads(out.stdout)["engines"]
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; s = u.find_spec('mori'); print(s.origin if s else '')"],
        env=env, capture_output=True, text=True, timeout=60,
    ).stdout.strip()
    if not found:
        assert engines["mori"] is False, out.stdout
    else:  # an AMD node with the real package: whatever is found is not our stand-in
        assert not os.path.abspath(found).startswith(os.path.abspath(STANDIN)), found


@pytest.mark.timeout(300)
def test_ext_classes_follow_the_release(ext, clean_activation):
    routed = ext.ext_classes(POLICY)
    if POLICY.is_live("F12") and not LIVE:  # F12's classes over stock (test_mori_newest.py)
        assert set(routed) == {"MoriKVManager", "MoriKVReceiver", "MoriKVBootstrapServer"}
        assert all(c.__module__ == "sglang_disagg_ext.backends.mori.metadata_order" for c in routed.values())
        return
    if not LIVE:
        assert routed == {}  # n/a before 0.5.12, upstream from 0.5.13: stock classes
        return
    stock = importlib.import_module("sglang.srt.disaggregation.mori.conn")
    assert set(routed) == {"MoriKVManager", "MoriKVSender", "MoriKVReceiver", "MoriKVBootstrapServer"}
    for name, cls in routed.items():
        assert issubclass(cls, getattr(stock, name)) and cls is not getattr(stock, name)
    # F12 is live on 0.5.12.x too: F3's manager carries its row checks.
    from sglang_disagg_ext.backends.mori.aux_rows import AuxRowCheckMixin

    assert issubclass(routed["MoriKVManager"], AuxRowCheckMixin)

    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    clean_activation.activate("mori-ext")
    # The engine-independent fixes live here (F14, backends.common.compose) wrap the plugin's manager
    # and keep its name.
    manager = get_kv_class(TransferBackend.MORI, KVClassType.MANAGER)
    assert issubclass(manager, ext.MoriExtKVManager) and manager.__name__ == "MoriExtKVManager", manager.__mro__
    assert get_kv_class(TransferBackend.MORI, KVClassType.BOOTSTRAP_SERVER) is ext.MoriExtKVBootstrapServer
    clean_activation.deactivate()
    assert get_kv_class(TransferBackend.MORI, KVClassType.MANAGER) is stock.MoriKVManager


# -- wire format, in process -------------------------------------------------------------------------

needs_live = pytest.mark.skipif(
    not LIVE, reason=f"F3 is {F3.value if F3 else 'unknown'} on SGLang {POLICY.version}: "
    "per-component MoRI wire exists only where the plugin installs it (0.5.12.x); asserted in "
    "test_ext_classes_follow_the_release"
)


@needs_live
@pytest.mark.timeout(300)
def test_stock_receiver_registration_crashes_on_per_component_state(ext, standin_modules):
    """The bug itself (0.5.12.post1 mori/conn.py:1423), through SGLang's own method."""
    mgr = _decode_side(standin_modules, [[96, 32], [128, 128]], [[768, 256], [1536, 1536]], [[], []])
    # Stock _register_local_buffers (:354-365) keeps the descriptors in one flat list.
    mgr.state_mem_descs = [d for comp in mgr.state_mem_descs for d in comp]
    rcv, _ = _receiver(ext.MoriExtKVReceiver, mgr)
    with pytest.raises(Exception, match=selftest_mori.STRUCT_ERROR):
        ext.MoriKVReceiver._register_kv_args(rcv)


@needs_live
@pytest.mark.timeout(300)
def test_registration_and_metadata_round_trip_per_component(ext, standin_modules):
    # Component 0: Mamba, two tensors, dims per tensor. Component 1: SWA with a
    # zero-length (elided) buffer kept as None. Component 2: no buffers at all.
    item_lens = [[96, 32], [128, 0], []]
    dims = [[3, 1], [], []]
    mgr = _decode_side(standin_modules, item_lens, [[768, 256], [1536, 0], []], dims)
    rcv, sock = _receiver(ext.MoriExtKVReceiver, mgr)
    rcv._register_kv_args()
    (frames,) = sock.sent
    # Stock's 14 frames (guard + 13), then F12's row-size frame: "SDXA", version 1, count 1, 64.
    assert frames[0] == ext.MORI_GUARD and len(frames) == 15
    assert frames[14] == b"SDXA" + bytes([1]) + struct.pack("<II", 1, 64)
    info = ext.MoriExtKVArgsRegisterInfo.from_zmq(frames[1:])
    assert info.dst_state_mem_descs == mgr.state_mem_descs
    assert info.dst_state_mem_descs[1][1] is None
    assert info.dst_state_item_lens == item_lens
    assert info.dst_state_dim_per_tensor == dims
    assert info.engine_key == mgr.engine_desc.key
    assert (info.endpoint, info.dst_port, info.dst_kv_item_len) == ("127.0.0.1", 4242, 256)

    # Metadata: None (component missing) stays distinct from [] (empty).
    rcv.send_metadata(np.array([4, 5], dtype=np.int32), 3, [[6], None, np.array([], dtype=np.int32)])
    rcv.send_metadata(np.array([4], dtype=np.int32), 3, None)
    with_state, without_state = (ext.MoriExtTransferInfo.from_zmq(f[1:]) for f in sock.sent[1:])
    assert with_state.room == 77 and with_state.wire_error is None
    assert with_state.dst_kv_indices.tolist() == [4, 5] and with_state.dst_aux_index == 3
    s = with_state.dst_state_indices
    assert len(s) == 3 and s[0].tolist() == [6] and s[1] is None and s[2].tolist() == []
    assert without_state.dst_state_indices is None


@needs_live
@pytest.mark.timeout(300)
def test_old_flat_registration_is_refused_with_a_clear_message(ext, standin_modules):
    from sglang_disagg_ext.core.state_wire import StateWireError

    # What stock 0.5.12.x MoRI sends: built by SGLang's own _register_kv_args.
    # (a) a plain KV model: empty state fields; (b) one flat state list.
    for item_lens, lens_bytes, flat in (([], [], True), ([96, 32], [768, 256], True)):
        mgr = _decode_side(standin_modules, [item_lens], [lens_bytes], [[]])
        mgr.kv_args.state_item_lens = item_lens  # flat, as the old layout had it
        mgr.kv_args.state_dim_per_tensor = []
        mgr.state_mem_descs = [d for comp in mgr.state_mem_descs for d in comp]
        rcv, sock = _receiver(ext.MoriExtKVReceiver, mgr)
        ext.MoriKVReceiver._register_kv_args(rcv)
        with pytest.raises(StateWireError) as err:
            ext.MoriExtKVArgsRegisterInfo.from_zmq(sock.sent[0][1:])
        message = str(err.value)
        assert "0.5.12.x MoRI" in message and "run the same plugin on both sides" in message

    # And the prefill manager refuses that peer at registration, then fails its
    # request with the reason instead of transferring.
    mgr_p = object.__new__(ext.MoriExtKVManager)
    KVPoll = ext.KVPoll
    mgr_p.__dict__.update(
        _refused_peers={}, _refused_lock=threading.Lock(), _pending_state=threading.local(),
        transfer_lock=threading.Lock(), request_status={77: KVPoll.Bootstrapping}, transfer_infos={},
        failure_records={}, failure_lock=threading.Lock(),
    )
    mgr_p._handle_register_message(sock.sent[0][1:])
    ((address, reason),) = mgr_p._refused_peers.items()
    assert address == ("127.0.0.1", 4242) and "at registration" in reason
    ext.MoriKVReceiver.send_metadata(rcv, np.array([4], dtype=np.int32), 3, None)  # stock metadata
    mgr_p._handle_transfer_message(sock.sent[1][1:])
    assert mgr_p.request_status[77] == KVPoll.WaitingForInput
    statuses, infos = mgr_p.add_transfer_request(77, np.array([1], dtype=np.int32), slice(0, 1), True, aux_index=0)
    assert statuses == [] and len(infos) == 1
    assert mgr_p.request_status[77] == KVPoll.Failed and mgr_p.failure_records[77] == reason


class _RecordingEngine:
    def __init__(self):
        self.writes = []
        self._uid = 0

    def allocate_transfer_uid(self):
        self._uid += 1
        return self._uid

    def batch_write(self, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids):
        self.writes.append((local_descs[0], local_offsets[0], remote_descs[0], remote_offsets[0], sizes[0]))
        return [object()]


def _dispatch_manager(ext, state_types):
    from sglang.srt.disaggregation.base.conn import StateType

    mgr = object.__new__(ext.MoriExtKVManager)
    mgr.engine = _RecordingEngine()
    mgr.kv_args = SimpleNamespace(
        state_types=[StateType(t) for t in state_types],
        state_item_lens=[[96, 32], [128, 128]],
        state_dim_per_tensor=[[], []],
        engine_rank=0,
    )
    mgr.state_mem_descs = [["m0", "m1"], ["s0", "s1"]]
    mgr.attn_tp_size = 1
    mgr.is_mla_backend = False
    peer = SimpleNamespace(
        dst_state_mem_descs=[["M0", "M1"], ["S0", "S1"]],
        dst_state_item_lens=[[96, 32], [128, 128]],
        dst_state_dim_per_tensor=[[], []],
        decode_tp_size=1,
        decode_tp_rank=0,
    )
    return mgr, peer


@needs_live
@pytest.mark.timeout(300)
def test_send_state_dispatches_each_component(ext):
    mgr, peer = _dispatch_manager(ext, ["mamba", "swa"])
    src = [np.array([3]), np.array([2, 3, 5, 6, 7])]
    dst = [np.array([6]), np.array([8, 9, 10, 4])]
    mgr.send_state(peer, src, dst)
    # Mamba: one whole slot per tensor (slot * item_len). SWA: the first four
    # pairs (2,8) (3,9) (5,10) (6,4) in three contiguous runs, 128-byte pages.
    swa = ([256, 640, 768], [1024, 1280, 512], [256, 128, 128])
    assert mgr.engine.writes == [
        ("m0", [288], "M0", [576], [96]),
        ("m1", [96], "M1", [192], [32]),
        ("s0", *swa[:1], "S0", *swa[1:]),
        ("s1", *swa[:1], "S1", *swa[1:]),
    ]

    # A missing component sends nothing; the other still goes.
    mgr.engine.writes.clear()
    mgr.send_state(peer, [None, np.array([1])], [np.array([6]), np.array([11])])
    assert [w[0] for w in mgr.engine.writes] == ["s0", "s1"]


@needs_live
@pytest.mark.timeout(300)
def test_mamba_never_takes_the_page_path(ext):
    from sglang_disagg_ext.core.state_plan import StateTransferError

    mgr, peer = _dispatch_manager(ext, ["mamba", "swa"])
    with pytest.raises(StateTransferError, match="exactly one slot"):
        mgr.send_state(peer, [np.array([3, 4]), None], [np.array([6, 7]), None])
    assert mgr.engine.writes == []
    # The same indices on an SWA component are pages.
    mgr, peer = _dispatch_manager(ext, ["swa", "swa"])
    mgr.kv_args.state_item_lens[0] = [96, 32]
    mgr.send_state(peer, [np.array([3, 4]), None], [np.array([6, 7]), None])
    assert mgr.engine.writes == [("m0", [288], "M0", [576], [192]), ("m1", [96], "M1", [192], [64])]


# -- engine: two processes -----------------------------------------------------------------------------


NA_REASON = (f"n/a on SGLang {POLICY.version}: F3 is n/a (MoRI has no hybrid-state send before 0.5.12); "
             "test_selftest_mori_rows_are_na_where_f3_is_na runs instead")
NOT_LIVE_REASON = (f"n/a on SGLang {POLICY.version}: F3 is {F3.value if F3 else 'unknown'}, so there is no plugin "
                   "MoRI wire here (mori-ext is stock's classes, or F12's, which keep stock's wire) and stock "
                   "bootstraps a hybrid model (0.5.13+) or has no MoRI state path (before 0.5.12)")


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(F3 is not releases.FixStatus.NA, reason=f"F3 is {F3.value if F3 else 'unknown'} on SGLang "
                    f"{POLICY.version}, not n/a: the engine tests below run")
def test_selftest_mori_rows_are_na_where_f3_is_na():
    """0.5.10.post1, 0.5.11: MoRI sends no hybrid state, so every MoRI selftest row says n/a for
    both names (counted as not run), none pass or fail."""
    rows = selftest_mori.mori_rows()
    assert rows and {r["ext"] for r in rows} == {"n/a"} and {r["stock"] for r in rows} == {"n/a"}, rows


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(F3 is releases.FixStatus.NA, reason=NA_REASON)
def test_two_component_request_ext():
    """mori-ext moves a Mamba slot and SWA pages, and decode holds exactly the expected bytes with
    sentinels untouched: through the plugin's F3 classes where F3 is live (0.5.12.x; the SWA page
    lists of different lengths trimmed, logged on prefill), through stock's classes where F3 is
    upstream (F12's manager where F12 is live, 0.5.23)."""
    _standin_or_skip()
    scn = selftest_mori.hybrid_scenario()
    expected = patterns.expected_after_request(scn, 0)
    assert len(expected[STATE_POOL_BASE].writes) == 1 and len(expected[STATE_POOL_BASE + 1].writes) == 4

    ext_res = selftest_mori.run(scn, "mori-ext", timeout_s=RUN_TIMEOUT)
    _assert_ok(ext_res)
    assert ext_res.state_types == ["mamba", "swa"]
    req0, req1 = ext_res.requests
    if LIVE:
        assert ext_res.prefill_manager == EXT_MANAGER == ext_res.decode_manager
        assert any("len(prefill_state_indices)=5, len(dst_state_indices)=4" in m for m in req0.prefill_log)
        assert req0.prefill_seconds < 5 and req0.decode_seconds < 5
    else:  # upstream release: F3 is stock's; F12's manager where live (0.5.23)
        expected = F12_MANAGER if POLICY.is_live("F12") else STOCK_MANAGER
        assert ext_res.prefill_manager == expected == ext_res.decode_manager


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(not LIVE, reason=NOT_LIVE_REASON)
def test_two_component_request_stock_dies_at_bootstrap():
    """Stock mori (0.5.12.x) dies at PD bootstrap of the same hybrid request with the
    ``struct.error`` of its flat registration format (test_two_component_request_ext: mori-ext
    serves it)."""
    _standin_or_skip()
    stock = selftest_mori.run(selftest_mori.hybrid_scenario(), "mori", timeout_s=RUN_TIMEOUT)
    assert stock.prefill_manager == STOCK_MANAGER
    assert not stock.ok and selftest_mori.stock_struct_error(stock), stock.describe()
    assert "struct.error" in (stock.requests[0].error or ""), stock.describe()


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(not LIVE, reason=NOT_LIVE_REASON)
def test_old_flat_decode_refused_at_registration():
    """mori-ext prefill, stock mori decode (plain KV model: the only one stock 0.5.12.x
    can bootstrap): refused at registration, decode ends Failed with the reason, no byte moves."""
    _standin_or_skip()
    res = selftest_mori.run(
        selftest_mori.kv_only_scenario("mori-flat-decode"), "mori-ext", decode_backend="mori", timeout_s=RUN_TIMEOUT
    )
    (req,) = res.requests
    assert res.prefill_manager == EXT_MANAGER and res.decode_manager == STOCK_MANAGER, res.describe()
    assert selftest_mori.refused_cleanly(res, "prefill"), res.describe()
    assert "0.5.12.x MoRI" in req.decode_failure_reason
    assert any("refused decode peer" in line for line in req.prefill_log), res.describe()
    assert req.decode_seconds is not None and req.decode_seconds < 5, res.describe()  # not a timeout


@pytest.mark.engine
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.skipif(not LIVE, reason=NOT_LIVE_REASON)
def test_stock_prefill_refused_by_ext_decode():
    """Stock mori prefill, mori-ext decode: decode refuses to register and fails the request."""
    _standin_or_skip()
    res = selftest_mori.run(
        selftest_mori.hybrid_scenario(), "mori", decode_backend="mori-ext", timeout_s=RUN_TIMEOUT
    )
    assert res.decode_manager == EXT_MANAGER, res.describe()
    assert selftest_mori.refused_cleanly(res, "decode"), res.describe()
    for r in res.requests:
        assert "runs stock `mori`" in r.decode_failure_reason
        assert "struct.error" not in (r.error or "")
