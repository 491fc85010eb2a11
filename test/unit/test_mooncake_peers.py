"""``backends.mooncake.peers``: what an ``-ext`` decode publishes and how a failure reason
crosses to it on releases whose decode loop unpacks exactly three status frames.

No engine and no manager: the mixin runs on a small stand-in base class that records
what stock's methods would have been asked to do. Expected frames and bounds are
written out by hand from the numbers in each test.
"""

import logging
import threading
from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.mooncake import peers
from sglang_disagg_ext.backends.common.shared import FilteringSocket, pool_bounds_frame
from sglang_disagg_ext.core.index_bounds import decode_frame

pytestmark = pytest.mark.timeout(10)


class RecordingSocket:
    def __init__(self, incoming=()):
        self.sent = []
        self.incoming = list(incoming)

    def send_multipart(self, frames, *args, **kwargs):
        self.sent.append(list(frames))

    def recv_multipart(self, *args, **kwargs):
        return self.incoming.pop(0)


class StockStandIn:
    """What the mixin calls on stock's manager: ``record_failure``, ``sync_status_to_decode_endpoint``, ``_connect``."""

    def record_failure(self, bootstrap_room, failure_reason):
        with self.failure_lock:
            self.failure_records[bootstrap_room] = failure_reason

    def sync_status_to_decode_endpoint(self, remote, dst_port, room, status, prefill_rank):
        self.stock_syncs.append((remote, dst_port, room, status, prefill_rank))

    def _connect(self, endpoint, is_ipv6=False):
        return self.sockets.setdefault(endpoint, RecordingSocket())


class Mgr(peers.PeerPoolsMixin, StockStandIn):
    pass


def _mgr(mode):
    mgr = object.__new__(Mgr)
    mgr.disaggregation_mode = mode
    mgr.failure_lock = threading.Lock()
    mgr.failure_records = {}
    mgr.stock_syncs = []
    mgr.sockets = {}
    mgr._peer_bounds = {}
    mgr._unchecked_peers = set()
    mgr._reason_endpoints = set()
    mgr._digest_endpoints = set()
    mgr._peer_reasons = {}
    mgr._refused_sessions = {}
    return mgr


@pytest.fixture
def three_frame_decode(monkeypatch):
    """Pretend the installed SGLang's decode unpacks exactly three status frames (0.5.10.post1-0.5.12.x)."""
    monkeypatch.setattr(releases.features(), "kv_status_codec", False)


def test_flat_layout_state_is_one_component():
    # KV: 2 buffers of 1024 bytes, 128-byte pages -> 8 pages. Aux: 640 / 64 -> 10 rows.
    # Flat state (0.5.10.post1/0.5.11): buffers of 800 and 1600 bytes, items of 100 and
    # 200 bytes -> 8 entries each, one component.
    kv_args = SimpleNamespace(kv_data_lens=[1024, 1024], kv_item_lens=[128, 128], aux_data_lens=[640],
                              aux_item_lens=[64], state_data_lens=[800, 1600], state_item_lens=[100, 200],
                              state_type="swa")
    bounds = decode_frame(pool_bounds_frame(kv_args, peers.logger))
    assert (bounds.kv, bounds.aux, bounds.state) == (8, 10, (8,))
    assert peers.state_kinds_of(kv_args) == ["swa"]


def test_per_component_state_and_no_state():
    # Component 0: 800 / 100 -> 8; component 1: 300 / 100 -> 3.
    kinds = [SimpleNamespace(value="swa"), SimpleNamespace(value="nsa")]
    kv_args = SimpleNamespace(kv_data_lens=[512], kv_item_lens=[128], aux_data_lens=[64], aux_item_lens=[64],
                              state_data_lens=[[800], [300]], state_item_lens=[[100], [100]], state_types=kinds)
    bounds = decode_frame(pool_bounds_frame(kv_args, peers.logger))
    assert (bounds.kv, bounds.aux, bounds.state) == (4, 1, (8, 3))
    assert peers.state_kinds_of(kv_args) == ["swa", "nsa"]
    flat_none = SimpleNamespace(state_type="none")
    assert peers.state_kinds_of(flat_none) == []


def test_unreadable_pool_sizes_publish_nothing(caplog):
    # A zero item length cannot give a page count: no frame, one error line, registration still goes out.
    kv_args = SimpleNamespace(kv_data_lens=[512], kv_item_lens=[0], aux_data_lens=[], aux_item_lens=[])
    with caplog.at_level(logging.ERROR, logger="sglang_disagg_ext.mooncake.peers"):
        assert pool_bounds_frame(kv_args, peers.logger) is None
    assert "not publishing pool sizes" in caplog.text


def test_registration_frame_selector():
    # Stock's registration message starts with the room field "None" and carries at least the session (frame 3).
    assert peers._is_registration([b"None", b"127.0.0.1", b"9000", b"127.0.0.1:1234", b""])
    assert not peers._is_registration([b"1000", b"127.0.0.1", b"9000", b"127.0.0.1:1234"])  # a room's metadata
    assert not peers._is_registration([b"None"])


def test_failed_status_to_an_ext_decode_carries_the_reason(three_frame_decode):
    mgr = _mgr(DisaggregationMode.PREFILL)
    mgr._reason_endpoints.add(("127.0.0.1", 7001))
    mgr.record_failure(1000, "decode session s: kv: destination index 40 ...")
    mgr.sync_status_to_decode_endpoint("127.0.0.1", 7001, 1000, KVPoll.Failed, 3)
    (sock,) = mgr.sockets.values()
    assert sock.sent == [[b"1000", str(int(KVPoll.Failed)).encode(), b"3",
                          b"sglang-disagg-ext:reason:decode session s: kv: destination index 40 ..."]]
    assert mgr.stock_syncs == []


def test_stock_decode_and_success_get_stocks_three_frames(three_frame_decode):
    mgr = _mgr(DisaggregationMode.PREFILL)
    mgr._reason_endpoints.add(("127.0.0.1", 7001))
    mgr.record_failure(1000, "why")
    mgr.sync_status_to_decode_endpoint("127.0.0.1", 7002, 1000, KVPoll.Failed, 0)  # published no sizes
    mgr.sync_status_to_decode_endpoint("127.0.0.1", 7001, 1001, KVPoll.Success, 0)
    mgr.sync_status_to_decode_endpoint("127.0.0.1", 7001, 1002, KVPoll.Failed, 0)  # no reason recorded
    assert mgr.stock_syncs == [("127.0.0.1", 7002, 1000, KVPoll.Failed, 0), ("127.0.0.1", 7001, 1001, KVPoll.Success, 0),
                               ("127.0.0.1", 7001, 1002, KVPoll.Failed, 0)]
    assert mgr.sockets == {}


def test_registration_decides_who_gets_reasons(three_frame_decode):
    from sglang_disagg_ext.core.index_bounds import PoolBounds, encode_frame

    mgr = _mgr(DisaggregationMode.PREFILL)
    ext = [b"None", b"127.0.0.1", b"7001", b"127.0.0.1:5001", b"", encode_frame(PoolBounds(kv=8, aux=4))]
    stock = [b"None", b"127.0.0.1", b"7002", b"127.0.0.1:5002", b""]
    mgr._note_if_registration(ext)
    mgr._note_if_registration(stock)
    mgr._note_if_registration([b"1000", b"127.0.0.1", b"7003", b"127.0.0.1:5003"])  # not a registration
    assert mgr._reason_endpoints == {("127.0.0.1", 7001)}
    assert mgr._peer_bounds["127.0.0.1:5001"].kv == 8
    assert mgr._unchecked_peers == {"127.0.0.1:5002"}
    # The same decode registering again as a stock one no longer gets reason frames.
    mgr._note_if_registration([b"None", b"127.0.0.1", b"7001", b"127.0.0.1:5001", b""])
    assert mgr._reason_endpoints == set()


def test_decode_takes_the_reason_frame_off_and_records_it():
    mgr = _mgr(DisaggregationMode.DECODE)
    failed = str(int(KVPoll.Failed)).encode()
    raw = RecordingSocket(incoming=[[b"1000", failed, b"0", b"sglang-disagg-ext:reason:kv: destination index 40"],
                                    [b"1001", failed, b"0"],
                                    [b"AUX_DATA", b"x", b"y", b"z"]])
    sock = FilteringSocket(raw, mgr._take_status_frame, logging.getLogger("test"))
    assert sock.recv_multipart() == [b"1000", failed, b"0"]  # what stock unpacks
    assert sock.recv_multipart() == [b"1001", failed, b"0"]
    assert sock.recv_multipart() == [b"AUX_DATA", b"x", b"y", b"z"]  # four frames, not a reason: unchanged
    # Stock's decode thread then records its generic reason for each Failed status.
    mgr.record_failure(1000, "Failed to get kvcache from prefill instance, it might be dead")
    mgr.record_failure(1001, "Failed to get kvcache from prefill instance, it might be dead")
    assert mgr.failure_records == {
        1000: "prefill failed the request: kv: destination index 40",
        1001: "Failed to get kvcache from prefill instance, it might be dead",
    }
    assert mgr._peer_reasons == {}


def test_registration_decides_who_gets_digests(three_frame_decode):
    """Only a decode whose frame says it reads digests (an -ext decode verifying) gets one."""
    from sglang_disagg_ext.core.index_bounds import PoolBounds, encode_frame

    mgr = _mgr(DisaggregationMode.PREFILL)
    verifying = encode_frame(PoolBounds(kv=8, aux=4, reads_digests=True))
    assert b'"digests": true' in verifying
    mgr._note_if_registration([b"None", b"127.0.0.1", b"7001", b"127.0.0.1:5001", b"", verifying])
    mgr._note_if_registration([b"None", b"127.0.0.1", b"7002", b"127.0.0.1:5002", b"",
                               encode_frame(PoolBounds(kv=8, aux=4))])
    mgr._note_if_registration([b"None", b"127.0.0.1", b"7003", b"127.0.0.1:5003", b""])  # stock
    assert mgr._digest_endpoints == {("127.0.0.1", 7001)}
    assert mgr._reason_endpoints == {("127.0.0.1", 7001), ("127.0.0.1", 7002)}
    # Registering again without the flag (verification switched off there): no more digests.
    mgr._note_if_registration([b"None", b"127.0.0.1", b"7001", b"127.0.0.1:5001", b"",
                               encode_frame(PoolBounds(kv=8, aux=4))])
    assert mgr._digest_endpoints == set()


def test_decode_takes_the_digest_frame_off_and_hands_it_on():
    mgr = _mgr(DisaggregationMode.DECODE)
    kept = []
    mgr._keep_digest_frame = lambda room, rank, frame, reply: kept.append((room, rank, frame, reply))
    ok = str(int(KVPoll.Success)).encode()
    raw = RecordingSocket(incoming=[[b"1000", ok, b"1", b"sglang-disagg-ext:digest:SDXD-frame-bytes"],
                                    [b"1001", ok, b"0"],
                                    # prefill's reply address as a fifth frame, after the digest
                                    [b"1003", ok, b"0", b"sglang-disagg-ext:digest:SDXD-2", b"SDXR1127.0.0.1|7100"],
                                    # five frames without a digest: not ours, handed on as sent
                                    [b"1004", ok, b"0", b"x", b"y"]])
    sock = FilteringSocket(raw, mgr._take_status_frame, logging.getLogger("test"))
    assert sock.recv_multipart() == [b"1000", ok, b"1"]  # what stock unpacks
    assert sock.recv_multipart() == [b"1001", ok, b"0"]
    assert sock.recv_multipart() == [b"1003", ok, b"0"]
    assert sock.recv_multipart() == [b"1004", ok, b"0", b"x", b"y"]
    assert kept == [(1000, 1, b"SDXD-frame-bytes", None), (1003, 0, b"SDXD-2", b"SDXR1127.0.0.1|7100")]
    # Without the verified-transfer mixin (this decode never asked for one) it is dropped.
    plain = _mgr(DisaggregationMode.DECODE)
    assert plain._take_status_frame([b"1002", ok, b"0", b"sglang-disagg-ext:digest:x"]) == [b"1002", ok, b"0"]


def test_conclude_room_failed_by_hand_tells_every_non_dummy_rank(monkeypatch):
    monkeypatch.setattr(releases.features(), "mooncake_conclude_failure", False)
    mgr = _mgr(DisaggregationMode.PREFILL)
    statuses = {}
    mgr.update_status = lambda room, status: statuses.__setitem__(room, status)
    mgr.attn_tp_rank, mgr.pp_rank, mgr.pp_size, mgr.attn_cp_rank, mgr.attn_cp_size = 1, 0, 1, 0, 1
    mgr.transfer_infos = {1000: {
        "a": SimpleNamespace(is_dummy=False, endpoint="127.0.0.1", dst_port=7001),
        "b": SimpleNamespace(is_dummy=True, endpoint="127.0.0.1", dst_port=7002),
        "c": SimpleNamespace(is_dummy=False, endpoint="127.0.0.1", dst_port=7003),
    }}
    peers.conclude_room_failed(mgr, 1000, "why")
    assert mgr.failure_records == {1000: "why"}
    assert statuses == {1000: KVPoll.Failed}
    # prefill unique rank = attn_tp_rank * (pp_size * attn_cp_size) + pp_rank * attn_cp_size + attn_cp_rank = 1
    assert mgr.stock_syncs == [("127.0.0.1", 7001, 1000, KVPoll.Failed, 1), ("127.0.0.1", 7003, 1000, KVPoll.Failed, 1)]


def test_sessions_refused_at_registration_one_table_for_f9_and_f18(monkeypatch):
    """F9 and F18 refuse sessions in one table: a room with a refused non-dummy rank is concluded
    Failed with the lowest-numbered fix's reason and counted under it; a dummy rank's refusal,
    or a session accepted again by every fix that refused it, leaves the room to stock."""
    monkeypatch.setattr(releases.features(), "mooncake_conclude_failure", False)
    mgr = _mgr(DisaggregationMode.PREFILL)
    statuses, counted, queued = {}, [], []
    mgr.update_status = lambda room, status: statuses.__setitem__(room, status)
    mgr.attn_tp_rank, mgr.pp_rank, mgr.pp_size, mgr.attn_cp_rank, mgr.attn_cp_size = 0, 0, 1, 0, 1
    monkeypatch.setattr(peers.metrics, "count", lambda name, **labels: counted.append((name, labels)))
    monkeypatch.setattr(StockStandIn, "add_transfer_request", lambda self, room, *a: queued.append(room),
                        raising=False)
    monkeypatch.setattr(StockStandIn, "send_aux", lambda self, req, *a: 0, raising=False)
    mgr.request_status = {1000: KVPoll.WaitingForInput, 1001: KVPoll.WaitingForInput}
    mgr.transfer_infos = {
        1000: {"a": SimpleNamespace(is_dummy=False, endpoint="127.0.0.1", dst_port=7001)},
        1001: {"d": SimpleNamespace(is_dummy=True, endpoint="127.0.0.1", dst_port=7002)},
    }
    mgr._refuse_session("a", "F18", "KV cache layouts differ", "layout reason")
    mgr._refuse_session("a", "F9", "metadata buffers cannot be paired", "buffers reason")
    mgr._refuse_session("d", "F18", "KV cache layouts differ", "dummy's reason")
    assert peers.refused_session(mgr, 1000) == ("a", "F9", "metadata buffers cannot be paired", "buffers reason")
    mgr.add_transfer_request(1000, "chunk")
    mgr.add_transfer_request(1001, "chunk")  # only a dummy rank is refused: stock's
    assert queued == [1001]
    assert mgr.failure_records == {1000: "buffers reason"} and statuses == {1000: KVPoll.Failed}
    assert counted == [("requests_refused_total", {"fix": "F9", "reason": "metadata buffers cannot be paired"})]
    assert mgr.stock_syncs == [("127.0.0.1", 7001, 1000, KVPoll.Failed, 0)]
    assert mgr.send_aux(SimpleNamespace(mooncake_session_id="a")) == -1
    # F9 accepts it again (re-registered with matching buffers): F18's refusal still stands.
    mgr._accept_session("a", "F9")
    mgr.request_status[1000] = KVPoll.WaitingForInput
    assert peers.refused_session(mgr, 1000) == ("a", "F18", "KV cache layouts differ", "layout reason")
    mgr._accept_session("a", "F18")
    assert peers.refused_session(mgr, 1000) is None and "a" not in mgr._refused_sessions
    assert mgr.send_aux(SimpleNamespace(mooncake_session_id="a")) == 0
    # A Failed room is stock's to drop whatever its sessions.
    mgr.request_status[1000] = KVPoll.Failed
    mgr._refuse_session("a", "F18", "KV cache layouts differ", "layout reason")
    assert peers.refused_session(mgr, 1000) is None
