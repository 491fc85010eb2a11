"""``backends.nixl.verify``: the blocks a NIXL WRITE moves, read from the descriptor lists
SGLang hands the agent (expected rows derived by hand), and the recording agent's
report of each transfer. No NIXL: a stand-in agent that only returns handles."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sglang_disagg_ext.backends.nixl.verify import (  # noqa: E402
    RecordingAgent,
    aux_notif_room,
    descriptor_blocks,
    split_digest,
    with_digest,
)


@pytest.mark.timeout(10)
def test_descriptor_blocks_reads_plain_and_strided_lists():
    plain = np.array([[0x1000, 64, 0], [0x2000, 32, 0]], dtype=np.uint64)
    assert descriptor_blocks(plain).tolist() == [[0x1000, 64], [0x2000, 32]]
    assert descriptor_blocks([(0x1000, 64, 0), (0x2000, 32, 1)]).tolist() == [[0x1000, 64], [0x2000, 32]]
    # (addr, len, dev, stride, count): 3 blocks of 16 bytes every 100 bytes, then 1 of 8.
    strided = np.array([[1000, 16, 0, 100, 3], [5000, 8, 0, 0, 1]], dtype=np.uint64)
    assert descriptor_blocks(strided).tolist() == [[1000, 16], [1100, 16], [1200, 16], [5000, 8]]
    assert descriptor_blocks([]).shape == (0, 2)
    assert descriptor_blocks(torch.zeros(4)) is None
    assert descriptor_blocks(np.zeros((2, 4), dtype=np.uint64)) is None


class _StandInAgent:
    """Returns a fresh object per list/handle/transfer; records what it was given."""

    name = "prefill-agent"

    def __init__(self):
        self.calls = []
        self.notifs = []

    def get_xfer_descs(self, descs, mem_type=None):
        return object()

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None):
        return object()

    def make_prepped_xfer(self, op, local, li, remote, ri, notif_msg=b""):
        self.calls.append(("make", op, list(li), list(ri)))
        self.notifs.append(notif_msg)
        return "xfer"

    def initialize_xfer(self, op, local, remote, agent, notif_msg=b""):
        self.calls.append(("init", op, agent))
        self.notifs.append(notif_msg)
        return "xfer"

    def get_new_notifs(self):
        return {"prefill-agent": [b"1000_kv_0_1_0", b"1000_aux_SDXV1.AAE=", b"1001_aux_nokv_0_SDXV0.AgM="]}

    def release_dlist_handle(self, handle):
        self.calls.append(("release",))


@pytest.mark.timeout(10)
def test_recording_agent_reports_each_write_before_it_is_created():
    reports = []
    agent = _StandInAgent()
    rec = RecordingAgent(agent, lambda peer, blocks, why: reports.append(
        (peer, None if blocks is None else blocks.tolist(), why, len(agent.calls))))
    assert rec.name == "prefill-agent"  # everything else is the agent's
    src = rec.prep_xfer_dlist("", np.array([[100, 8, 0, 8, 4]], dtype=np.uint64), "DRAM")  # 100,108,116,124
    dst = rec.prep_xfer_dlist("decode-7", np.array([[900, 8, 0], [700, 8, 0], [500, 8, 0]], dtype=np.uint64), "DRAM")
    assert rec.make_prepped_xfer("WRITE", src, [3, 0], dst, [2, 1]) == "xfer"
    # (src, dst, len) of the indexed blocks, reported before the agent created the transfer.
    assert reports[-1] == ("decode-7", [[124, 500, 8], [100, 700, 8]], None, 0)
    d_src = rec.get_xfer_descs([(40, 16, 0)], "DRAM")
    d_dst = rec.get_xfer_descs(np.array([[64, 16, 0]], dtype=np.uint64), "DRAM")
    rec.initialize_xfer("WRITE", d_src, d_dst, "decode-9")
    assert reports[-1] == ("decode-9", [[40, 64, 16]], None, 1)
    rec.initialize_xfer("READ", d_src, d_dst, "decode-9")  # reads are not writes: not reported
    assert len(reports) == 2
    # Lengths that do not pair up, an unknown handle: reported as unknown, the transfer still made.
    d_short = rec.get_xfer_descs([(64, 8, 0)], "DRAM")
    rec.initialize_xfer("WRITE", d_src, d_short, "decode-9")
    assert reports[-1][0] == "decode-9" and reports[-1][1] is None and "differ" in reports[-1][2]
    rec.release_dlist_handle(dst)
    rec.make_prepped_xfer("WRITE", src, [0], dst, [0])
    assert reports[-1][:3] == ("", None, "a prepared remote list the verifier did not see")
    assert agent.calls[-1][0] == "make"


@pytest.mark.timeout(10)
def test_aux_notification_digest_field_by_hand():
    """The field is ``_SDXV<rank>.<base64>``: frame bytes 00 01 are ``AAE=`` in base64."""
    assert aux_notif_room(b"1000_aux") == 1000
    assert aux_notif_room("1001_aux_nokv_3") == 1001
    assert aux_notif_room(b"1000_kv_0_1_0") is None and aux_notif_room(b"x_aux") is None
    assert with_digest(b"7_aux", 2, b"\x00\x01") == b"7_aux_SDXV2.AAE="
    assert with_digest("7_aux_nokv_3", 0, b"\x00\x01") == "7_aux_nokv_3_SDXV0.AAE="
    # What stock decodes read (0.5.11: split("_", 4); 0.5.12.x: split("_", 8)): the fields
    # before it, unchanged (the nokv marker's rank is field 3).
    assert "7_aux_SDXV2.AAE=".split("_", 4)[:2] == ["7", "aux"]
    assert "7_aux_nokv_3_SDXV0.AAE=".split("_", 8)[2:4] == ["nokv", "3"]
    assert split_digest(b"7_aux_SDXV2.AAE=") == (b"7_aux", 2, b"\x00\x01", None)
    assert split_digest(b"7_aux_nokv_3") == (b"7_aux_nokv_3", None, None, None)
    # Unreadable: the field is still taken off, no frame.
    assert split_digest(b"7_aux_SDXVx.AAE=") == (b"7_aux", None, None, None)
    assert split_digest(b"7_aux_SDXV1.A*E=") == (b"7_aux", None, None, None)
    # With prefill's reply address (where its bootstrap loop takes notices): one more
    # ".<base64>"; b"SDXR1h|5" is U0RY UjFo fDU= by hand (53 44 58 | 52 31 68 | 7c 35).
    assert with_digest(b"7_aux", 2, b"\x00\x01", b"SDXR1h|5") == b"7_aux_SDXV2.AAE=.U0RYUjFofDU="
    assert "7_aux_SDXV2.AAE=.U0RYUjFofDU=".split("_", 8)[:2] == ["7", "aux"]
    assert split_digest(b"7_aux_SDXV2.AAE=.U0RYUjFofDU=") == (b"7_aux", 2, b"\x00\x01", b"SDXR1h|5")
    assert split_digest(b"7_aux_SDXV2.AAE=.U0R*") == (b"7_aux", None, None, None)


@pytest.mark.timeout(10)
def test_recording_agent_rewrites_notifications_through_its_hooks():
    agent = _StandInAgent()
    seen = []
    rec = RecordingAgent(agent, lambda *a: None, on_notif=lambda peer, tag: seen.append((peer, tag)) or tag + b"!",
                         on_notifs=lambda notifs: {p: [m.split(b"_SDXV")[0] for m in ms] for p, ms in notifs.items()})
    d_src = rec.get_xfer_descs([(40, 16, 0)], "DRAM")
    d_dst = rec.get_xfer_descs([(64, 16, 0)], "DRAM")
    rec.initialize_xfer("WRITE", d_src, d_dst, "decode-9", b"5_aux")
    src = rec.prep_xfer_dlist("", [(40, 16, 0)], "DRAM")
    dst = rec.prep_xfer_dlist("decode-7", [(64, 16, 0)], "DRAM")
    rec.make_prepped_xfer("WRITE", src, [0], dst, [0], notif_msg=b"6_kv_0_1_0")
    rec.initialize_xfer("READ", d_src, d_dst, "decode-9", b"8_aux")  # not a write: as given
    assert seen == [("decode-9", b"5_aux"), ("decode-7", b"6_kv_0_1_0")]
    assert agent.notifs == [b"5_aux!", b"6_kv_0_1_0!", b"8_aux"]
    assert rec.get_new_notifs() == {"prefill-agent": [b"1000_kv_0_1_0", b"1000_aux", b"1001_aux_nokv_0"]}
