"""Decode tells a refused prefill that its requests are over (``core.prefill_notice``,
``backends.common.prefill_notice``).

Expected values by hand. The adapter runs against a stand-in of prefill's bootstrap server (an
``http.server`` answering ``/route`` with hand-written JSON: two attention-TP ranks, each naming a
real ZMQ PULL socket of the test) and real ZMQ sockets; the real pairs are
``test/integration/test_decode_pairing_check.py`` (F14) and ``test/mixed`` (F19), where prefill's own
bootstrap thread reads the notice.
"""

import http.server
import json
import logging
import threading
import urllib.parse

import pytest
import zmq

from sglang_disagg_ext.backends.common.prefill_notice import PrefillNotice
from sglang_disagg_ext.core import prefill_notice
from sglang_disagg_ext.core.prefill_notice import abort_frames, aborted_room, endpoint, rank_queries, takes_abort

ANSWER_0_5_11 = {"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 1}
ANSWER_0_5_23 = {**ANSWER_0_5_11, "decode_allocation_policy": "early", "enable_kv_cache_sharding": False}


@pytest.mark.timeout(10)
def test_only_a_prefill_from_0_5_22_on_takes_abort():
    assert takes_abort(ANSWER_0_5_23)
    assert not takes_abort(ANSWER_0_5_11)


@pytest.mark.timeout(10)
def test_rank_queries_cover_every_rank():
    answer = {"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1}
    assert rank_queries(answer) == [
        {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0},
        {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 1, "target_pp_rank": 0},
        {"prefill_dp_rank": 1, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0},
        {"prefill_dp_rank": 1, "prefill_cp_rank": 0, "target_tp_rank": 1, "target_pp_rank": 0},
    ]
    no_cp = {"attn_tp_size": 1, "dp_size": 1, "pp_size": 2}  # an answer without attn_cp_size: one cp rank
    assert [q["target_pp_rank"] for q in rank_queries(no_cp)] == [0, 1]
    assert rank_queries({**answer, "pp_size": 0}) == []
    assert rank_queries({**answer, "attn_tp_size": "2"}) == []
    assert rank_queries({**answer, "dp_size": 64, "attn_tp_size": 32}) == []  # 2048 ranks: not believed


@pytest.mark.timeout(10)
def test_endpoint_and_frames():
    assert endpoint({"rank_ip": "10.0.0.5", "rank_port": 17001}) == "tcp://10.0.0.5:17001"
    assert endpoint({"rank_ip": "fd00::5", "rank_port": "17001"}) == "tcp://[fd00::5]:17001"
    assert abort_frames(1234) == (b"ABORT", b"1234")


class _Bootstrap(http.server.ThreadingHTTPServer):
    """Prefill's bootstrap server, by hand: /route with every rank -1 gives ``answer``; with a rank,
    that rank's ``rank_ip``/``rank_port``."""

    def __init__(self, answer, ports):
        self.answer, self.ports, self.queries = answer, ports, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                query = {k: int(v[0]) for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).items()}
                outer.queries.append(query)
                if query["target_tp_rank"] == -1:
                    body = outer.answer
                else:
                    body = {"rank_ip": "127.0.0.1", "rank_port": outer.ports[query["target_tp_rank"]]}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def prefill(request):
    context = zmq.Context.instance()
    pulls = [context.socket(zmq.PULL) for _ in range(2)]
    ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in pulls]
    server = _Bootstrap(request.param, ports)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", server, pulls
    server.shutdown()
    server.server_close()
    for s in pulls:
        s.close(linger=0)


def _received(sock, wait_ms=2000):
    out = []
    while sock.poll(wait_ms):
        out.append(tuple(sock.recv_multipart()))
        wait_ms = 300
    return out


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefill", [ANSWER_0_5_23], indirect=True)
def test_each_rank_gets_an_abort_for_each_room_at_each_send_time(prefill, monkeypatch):
    monkeypatch.setattr(prefill_notice, "SEND_AT_S", (0.0, 0.2))
    addr, server, pulls = prefill
    PrefillNotice()._ext_send_notices(addr, (7, 8))
    for sock in pulls:
        assert _received(sock) == [(b"ABORT", b"7"), (b"ABORT", b"8")] * 2
    assert [q["target_tp_rank"] for q in server.queries] == [-1, 0, 1]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefill", [ANSWER_0_5_11], indirect=True)
def test_a_prefill_before_0_5_22_is_not_sent_anything(prefill, caplog):
    addr, server, pulls = prefill
    mgr = PrefillNotice()
    with caplog.at_level(logging.WARNING, logger="sglang_disagg_ext.prefill_notice"):
        mgr._ext_send_notices(addr, (7,))
        mgr._ext_send_notices(addr, (9,))  # remembered: not asked again, not warned again
    assert all(_received(sock, 500) == [] for sock in pulls)
    assert len(server.queries) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "takes no ABORT message" in warnings[0] and addr in warnings[0]


@pytest.mark.timeout(20)
def test_an_unreachable_prefill_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_disagg_ext.prefill_notice"):
        PrefillNotice()._ext_send_notices("127.0.0.1:9", (7,))  # port 9 (discard): refused at once
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "could not tell prefill 127.0.0.1:9" in caplog.records[0].getMessage()


@pytest.mark.timeout(10)
def test_aborted_room_reads_frame_1_of_an_abort_and_nothing_else():
    assert aborted_room(list(abort_frames(1234))) == 1234
    assert aborted_room([b"ABORT", b"77", b"10.0.0.1", b"9000", b"\x01"]) == 77  # 0.5.19+ frames after the room
    assert aborted_room([b"ABORT"]) is None and aborted_room([b"ABORT", b"x7"]) is None
    assert aborted_room([b"NixlMsgGuard", b"77"]) is None and aborted_room([]) is None
