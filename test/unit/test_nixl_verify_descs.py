"""``backends.nixl_verify``: the blocks a NIXL WRITE moves, read from the descriptor lists
SGLang hands the agent (expected rows derived by hand), and the recording agent's
report of each transfer. No NIXL: a stand-in agent that only returns handles."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sglang_disagg_ext.backends.nixl_verify import RecordingAgent, descriptor_blocks  # noqa: E402


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

    def get_xfer_descs(self, descs, mem_type=None):
        return object()

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None):
        return object()

    def make_prepped_xfer(self, op, local, li, remote, ri, notif_msg=b""):
        self.calls.append(("make", op, list(li), list(ri)))
        return "xfer"

    def initialize_xfer(self, op, local, remote, agent, notif_msg=b""):
        self.calls.append(("init", op, agent))
        return "xfer"

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
