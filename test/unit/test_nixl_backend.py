"""nixl-ext pieces that need SGLang's classes but no transfer engine.

* The installed release's *stock* decode parser (``NixlKVManager.update_transfer_status``)
  completes a P=2 -> D=1 room on the tags an ext prefill sends, and does not
  on tags where both ranks carry the same sender field (stock <= 0.5.11).
* The decode-side agent wrapper turns a prefill's failure tag into Failed.
* Impossible head layouts are refused with the numbers in the message.
* Destination bounds: the decode's registration gains one trailing pool-sizes frame
  (and nothing else), prefill notes it from the raw message, and a room whose KV or aux
  index lies outside is named with the index and the pool size.
"""

import logging
from collections import defaultdict
from types import SimpleNamespace

import pytest

# Plain imports: SGLang's nixl/conn.py imports NIXL only inside the manager, and the
# plugin's own module must import on every release; an ImportError here is a failure.
import sglang.srt.disaggregation.nixl.conn as conn  # noqa: E402
import sglang_disagg_ext.backends.nixl.conn as nixl_ext  # noqa: E402

from sglang_disagg_ext.backends.common.shared import FilteringSocket, FrameAppendingSocket, pool_bounds_frame  # noqa: E402
from sglang_disagg_ext.core.head_slice import HeadLayoutError  # noqa: E402
from sglang_disagg_ext.core.nixl_notif import failure_tag, with_sender_id  # noqa: E402
from sglang_disagg_ext.core.nixl_quorum import RoomQuorum  # noqa: E402

ROOM = 4242

from sglang_disagg_ext import releases  # noqa: E402

# The notification parser these tests drive is the one nixl-ext runs against:
# releases where F4's classes are nixl-ext's (0.5.13+ pass through; on 0.5.23
# nixl-ext is F11's class over stock, whose NIXL path no longer uses these tags).
_POLICY = releases.current_policy()
active_only = pytest.mark.skipif(
    not (_POLICY.is_live("F4") or "F4" in _POLICY.patched),
    reason=f"n/a on SGLang {_POLICY.version}: F4's classes are not nixl-ext's there (F13's class "
    "over stock on 0.5.13-0.5.21, F11's on 0.5.22/0.5.23), so the plugin's notification parser is not in use",
)


class FakeAgent:
    def __init__(self, notifs):
        self.notifs = notifs

    def get_new_notifs(self):
        out, self.notifs = self.notifs, {}
        return out


def stock_decode(agent, required=2):
    """A stock NixlKVManager (decode side) with only what update_transfer_status reads."""
    mgr = object.__new__(conn.NixlKVManager)
    mgr.agent = agent
    mgr.transfer_statuses = defaultdict(conn.TransferStatus)
    mgr.required_prefill_response_num_table = {ROOM: required}
    mgr.enable_staging = False
    mgr._staging_handler = None
    return mgr


def prefill_tags(engine_rank, pp_rank=0, stock_field=0):
    """What one prefill rank emits for a 2-chunk room: stock tags, then ext's rewrite."""
    stock = [f"{ROOM}_kv_0_0_{stock_field}", f"{ROOM}_kv_1_1_{stock_field}", f"{ROOM}_aux"]
    return [with_sender_id(t, pp_rank, engine_rank).encode() for t in stock]


@active_only
def test_stock_decode_completes_on_ext_keys():
    agent = FakeAgent({"prefill-a": prefill_tags(0), "prefill-b": prefill_tags(1)})
    mgr = stock_decode(agent)
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM)
    assert not mgr.transfer_statuses[ROOM].is_failed()


@active_only
def test_stock_decode_waits_when_ranks_share_a_key():
    same = [f"{ROOM}_kv_0_0_0".encode(), f"{ROOM}_kv_1_1_0".encode(), f"{ROOM}_aux".encode()]
    mgr = stock_decode(FakeAgent({"prefill-a": same, "prefill-b": list(same)}))
    mgr.update_transfer_status()
    assert not mgr.check_transfer_done(ROOM)


@active_only
def test_stock_decode_keeps_pipeline_stages_apart():
    # PP 2 x TP 1 prefill -> PP 1 decode: two responses, both TP rank 0.
    agent = FakeAgent({"a": prefill_tags(0, pp_rank=0), "b": prefill_tags(0, pp_rank=1)})
    mgr = stock_decode(agent)
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM)


@active_only
def test_stock_decode_ignores_failure_tags():
    tag = failure_tag(ROOM, 0, 1, "boom").encode()
    mgr = stock_decode(FakeAgent({"a": [tag]}))
    mgr.update_transfer_status()  # no exception, nothing marked
    assert not mgr.check_transfer_done(ROOM)


def ext_decode(tags, required=2):
    """An ext NixlExtKVManager (decode side) with only what stock's update_transfer_status reads."""
    mgr = object.__new__(nixl_ext.NixlExtKVManager)
    mgr._ext_is_prefill = False
    mgr._ext_quorum = RoomQuorum()
    mgr.transfer_statuses = defaultdict(conn.TransferStatus)
    mgr.required_prefill_response_num_table = {ROOM: required}
    mgr.enable_staging = False
    mgr._staging_handler = None
    mgr.failure_records = {}
    mgr.failure_lock = __import__("threading").Lock()
    mgr.agent = nixl_ext.ExtNixlAgent(FakeAgent(tags), mgr)
    return mgr


@active_only
def test_ext_decode_turns_failure_tag_into_failed():
    # Rank 0 concluded (all its tags, aux included); rank 1 gave up: Failed at once.
    fail = failure_tag(ROOM, 0, 1, "State index length mismatch").encode()
    mgr = ext_decode({"a": prefill_tags(0), "b": prefill_tags(1)[:1] + [fail]})
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM)
    assert mgr.transfer_statuses[ROOM].is_failed()
    assert "State index length mismatch" in mgr.failure_records[ROOM]


@active_only
def test_ext_decode_waits_for_every_ranks_aux_row():
    # Stock completes on the first aux (rank 0's), though rank 1's row has not landed.
    tags = {"a": prefill_tags(0), "b": prefill_tags(1)[:2]}
    stock = stock_decode(FakeAgent(dict(tags)))
    stock.update_transfer_status()
    assert stock.check_transfer_done(ROOM) and not stock.transfer_statuses[ROOM].is_failed()
    mgr = ext_decode(dict(tags))
    mgr.update_transfer_status()
    assert not mgr.check_transfer_done(ROOM)
    # Rank 1's aux post fails: rank 1 says so, and the room ends Failed, not Success.
    mgr.agent._agent.notifs = {"b": [failure_tag(ROOM, 0, 1, "NIXL transfer encountered ERR").encode()]}
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM) and mgr.transfer_statuses[ROOM].is_failed()
    # Had rank 1's aux landed instead, the room completes.
    ok = ext_decode({"a": prefill_tags(0), "b": prefill_tags(1)})
    ok.update_transfer_status()
    assert ok.check_transfer_done(ROOM) and not ok.transfer_statuses[ROOM].is_failed()


@active_only
def test_ext_decode_holds_a_failure_while_another_rank_still_writes():
    fail = failure_tag(ROOM, 0, 1, "ERR").encode()
    mgr = ext_decode({"b": [fail]})
    mgr.update_transfer_status()
    assert not mgr.check_transfer_done(ROOM)  # rank 0 has not concluded: its writes may be in flight
    mgr.agent._agent.notifs = {"a": prefill_tags(0)}
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM) and mgr.transfer_statuses[ROOM].is_failed()


def prefill_mgr(tp, per_rank, total):
    mgr = object.__new__(nixl_ext.NixlExtKVManager)
    mgr.attn_tp_size = tp
    mgr.kv_args = SimpleNamespace(kv_head_num=per_rank, total_kv_head_num=total)
    mgr._ext_total_kv_heads = None
    mgr._ext_layouts = {}
    return mgr


@pytest.mark.parametrize(
    "tp,per_rank,total,message",
    [
        (2, 1, 3, "prefill TP size 2 does not divide the 3 KV heads"),
        (4, 1, 3, "3 KV heads cannot be replicated evenly over prefill TP size 4"),
        (2, 0, 0, "kv_head_num (per rank) must be positive, got 0"),
        (2, 2, 2, "prefill pool holds 2 KV heads per rank, but 2 total KV heads over attention TP size 2 means 1"),
    ],
)
def test_own_layout_refused(tp, per_rank, total, message):
    with pytest.raises(HeadLayoutError) as err:
        prefill_mgr(tp, per_rank, total)._ext_check_own_heads()
    assert message in str(err.value)


def test_peer_layout_refused_names_numbers():
    mgr = prefill_mgr(1, 3, 3)
    mgr._ext_check_own_heads()
    with pytest.raises(HeadLayoutError) as err:
        mgr._ext_layout(1, 2)
    assert "3 KV heads from prefill TP size 1 to decode TP size 2" in str(err.value)
    assert "decode TP size 2 does not divide the 3 KV heads" in str(err.value)


def test_ext_classes_by_support():
    from sglang_disagg_ext import releases

    active = releases.policy_for("0.5.11")
    assert set(nixl_ext.ext_classes(active)) == {"NixlKVManager", "NixlKVSender", "NixlKVReceiver"}
    # 0.5.13-0.5.21: F13 alone, over stock's manager; a release the table does not list passes through.
    (manager,) = nixl_ext.ext_classes(releases.policy_for("0.5.20")).items()
    assert manager[0] == "NixlKVManager" and manager[1].__name__ == "NixlSwaTpKVManager"
    assert nixl_ext.ext_classes(releases.policy_for("0.5.19.post1")) == {}


class RecordingSocket:
    def __init__(self, incoming=()):
        self.sent = []
        self.incoming = list(incoming)
        self.closed = False

    def send_multipart(self, frames):
        self.sent.append(list(frames))

    def recv_multipart(self):
        return self.incoming.pop(0)

    def close(self):
        self.closed = True


# A decode registration as 0.5.10.post1-0.5.12.x send it (GUARD, room "None", ip, port,
# agent name, metadata, ...); only the positions the plugin reads matter here.
REGISTRATION = [b"GUARD", b"None", b"127.0.0.1", b"17000", b"decode-agent", b"meta", b"kvptrs"]


def test_pool_bounds_frame_from_decode_kv_args():
    from sglang_disagg_ext.core.index_bounds import decode_frame

    # 2 KV buffers of 4096 bytes with 512-byte pages -> 8 pages; one of 3584 -> 7 bound them all.
    # Aux: 2 buffers, 64 bytes / 8-byte rows = 8 rows and 96 / 16 = 6 rows -> 6.
    kv_args = SimpleNamespace(kv_data_lens=[4096, 3584], kv_item_lens=[512, 512],
                              aux_data_lens=[64, 96], aux_item_lens=[8, 16])
    b = decode_frame(pool_bounds_frame(kv_args, nixl_ext.logger, state=False))
    assert (b.kv, b.aux, b.state, b.aux_item_lens) == (7, 6, (), (8, 16))
    assert pool_bounds_frame(SimpleNamespace(kv_data_lens=[1], kv_item_lens=[0], aux_data_lens=[], aux_item_lens=[]),
                             nixl_ext.logger, state=False) is None


def test_appending_socket_touches_registrations_only():
    raw = RecordingSocket()
    sock = FrameAppendingSocket(raw, b"FRAME", nixl_ext._is_registration)
    sock.send_multipart(REGISTRATION)
    sock.send_multipart([b"GUARD", b"4242", b"127.0.0.1"])  # a room's metadata: unchanged
    sock.close()  # anything else reaches the real socket
    assert raw.sent == [REGISTRATION + [b"FRAME"], [b"GUARD", b"4242", b"127.0.0.1"]]
    assert raw.closed


def test_noting_socket_passes_messages_and_survives_its_note():
    seen = []

    def note(msg):
        seen.append(msg)
        raise RuntimeError("a bug in the note")

    raw = RecordingSocket(incoming=[REGISTRATION])
    assert FilteringSocket(raw, note, logging.getLogger("test")).recv_multipart() == REGISTRATION
    assert seen == [REGISTRATION]


def _bounds_mgr():
    mgr = object.__new__(nixl_ext.NixlExtKVManager)
    mgr._ext_peer_bounds = {}
    mgr._ext_unchecked_peers = set()
    return mgr


def test_prefill_notes_bounds_and_names_bad_indices():
    import numpy as np

    from sglang_disagg_ext.core.index_bounds import PoolBounds, encode_frame

    mgr = _bounds_mgr()
    mgr._ext_note_registration(REGISTRATION + [encode_frame(PoolBounds(kv=8, aux=4))])
    assert mgr._ext_peer_bounds["decode-agent"].kv == 8

    def req(kv, aux):
        return SimpleNamespace(agent_name="decode-agent", dst_kv_indices=np.asarray(kv, dtype=np.int32),
                               dst_aux_index=aux)

    assert mgr._ext_destination_error(req([0, 7, 3], 3)) is None
    assert mgr._ext_destination_error(req([2, 8], 0)) == (
        "decode decode-agent: kv: destination index 8 (position 1 of 2) outside decode's pool of 8 pages "
        "(valid 0..7)")
    assert mgr._ext_destination_error(req([1], 4)) == (
        "decode decode-agent: aux: destination index 4 outside decode's pool of 4 rows (valid 0..3)")
    # A stock decode (no frame) re-registering: unchecked from then on, and said once.
    mgr._ext_note_registration(REGISTRATION)
    mgr._ext_note_registration(REGISTRATION)
    assert "decode-agent" not in mgr._ext_peer_bounds and mgr._ext_unchecked_peers == {"decode-agent"}
    assert mgr._ext_destination_error(req([99], 99)) is None
    # Not a registration (a room's metadata), or a malformed frame: nothing noted.
    mgr._ext_note_registration([b"GUARD", b"4242", b"x", b"y", b"decode-b"])
    mgr._ext_note_registration(REGISTRATION[:4] + [b"decode-c", b"m", b"sglang-disagg-ext:pool-bounds:v1:{bad"])
    assert set(mgr._ext_peer_bounds) == set()


# Read by hand in each wheel's nixl/conn.py (F13). stock_nixl_prep_serves_decode_replicas: the
# prepared head-slice lists count unique slices (dst_replication) from 0.5.17 (:842); 0.5.13-0.5.16
# lay out one group per decode rank (0.5.16 :771-776); up to 0.5.12.x nothing is prepared.
# stock_nixl_worker_tells_decode: transfer_worker calls conclude_failure from 0.5.20 (:1481).
_NIXL_FACTS = {
    **{r: (True, False) for r in ("0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1")},
    **{r: (False, False) for r in ("0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16")},
    **{r: (True, False) for r in ("0.5.17", "0.5.18", "0.5.19")},
    **{r: (True, True) for r in ("0.5.20", "0.5.21", "0.5.22", "0.5.23")},
}
# Read by hand (the registration refusal shared by F11 and F13, backends/nixl/registration.py):
# (nixl_conclude_failure: common/conn.py defines conclude_failure from 0.5.20;
#  nixl_is_dummy_method: nixl TransferInfo.is_dummy is a method up to 0.5.19 (0.5.19 :171), a field
#  from 0.5.20 (:175); stock_nixl_sender_bootstrap_deadline: NixlKVSender.poll calls
#  _check_bootstrap_timeout from 0.5.18, 0.5.23 through common _poll_with_status :2368-2371).
_NIXL_REGISTRATION_FACTS = {
    **{r: (False, True, False) for r in ("0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13",
                                        "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17")},
    **{r: (False, True, True) for r in ("0.5.18", "0.5.19")},
    **{r: (True, False, True) for r in ("0.5.20", "0.5.21", "0.5.22", "0.5.23")},
}


# Read by hand: how a NIXL decode learns a room's Success (where verified transfers carry the digest).
# (nixl_success_via_notifications_only, nixl_success_via_listener_only, nixl_empty_state_lists_wait):
#  up to 0.5.19 NixlKVReceiver.poll concludes through check_transfer_done and NixlKVManager has no status
#  message; 0.5.20-0.5.22 poll still concludes through check_transfer_done (0.5.20 :3257, 0.5.22 :3512) and the
#  manager has the common codec, but nixl/conn.py sends only failures (conclude_failure, 0.5.20 :1481, 0.5.22
#  :1575); its worker sets Success on prefill alone (update_status, 0.5.20 :1438, 0.5.22 :1532); 0.5.23's
#  poll reads check_status only and its worker calls conclude_transfer (:1902). Up to 0.5.22 the decode's
#  TransferStatus.is_done waits for a state notification once expects_state is set (0.5.11 :1222, 0.5.19 :2980,
#  0.5.20 :3235); 0.5.23 has no expects_state.
_NIXL_SUCCESS_PATH = {
    **{r: (True, False, True) for r in ("0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1",
                                        "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
                                        "0.5.19", "0.5.20", "0.5.21", "0.5.22")},
    "0.5.23": (False, True, False),
}


@pytest.mark.timeout(20)
def test_nixl_probes_match_the_wheel_read_by_hand():
    from sglang_disagg_ext import releases

    version = releases.installed_sglang_version()
    if version not in _NIXL_FACTS:
        pytest.skip(f"n/a: SGLang {version} was not read by hand")
    f = releases.features()
    assert (f.stock_nixl_prep_serves_decode_replicas, f.stock_nixl_worker_tells_decode) == _NIXL_FACTS[version]
    assert (f.nixl_conclude_failure, f.nixl_is_dummy_method,
            f.stock_nixl_sender_bootstrap_deadline) == _NIXL_REGISTRATION_FACTS[version]
    assert (f.nixl_success_via_notifications_only, f.nixl_success_via_listener_only,
            f.nixl_empty_state_lists_wait) == _NIXL_SUCCESS_PATH[version]
