"""The in-tree PD load balancer (sglang_disagg_ext.deploy.mini_lb).

The mini LB runs as a real process; the prefill and decode servers behind it are
``test/support/sglang_standin`` processes (real HTTP servers that record what
they receive), because a real SGLang server cannot run on this CPU-only machine.
"""

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from sglang_disagg_ext.deploy import commands as cmds
from sglang_disagg_ext.deploy import mini_lb
from sglang_disagg_ext.deploy.commands import ServerSpec
from sglang_disagg_ext.deploy.procs import Launcher, free_ports

ROOT = Path(__file__).resolve().parents[2]
STANDIN_DIR = str(ROOT / "test" / "support" / "sglang_standin")


@pytest.mark.timeout(30)
def test_bootstrap_fields_single_and_batch():
    single = mini_lb.add_bootstrap({"text": "hi"}, "10.0.0.1", 8998, rooms=[42])
    assert single == {"text": "hi", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42}
    batch = mini_lb.add_bootstrap({"input_ids": [[1, 2], [3]]}, "10.0.0.1", 8998, rooms=[5, 6])
    assert batch["bootstrap_host"] == ["10.0.0.1", "10.0.0.1"]
    assert batch["bootstrap_port"] == [8998, 8998]
    assert batch["bootstrap_room"] == [5, 6]
    assert mini_lb.batch_size({"input_ids": [1, 2, 3]}) is None
    assert mini_lb.bootstrap_host("http://[fe80::1]:30000") == "[fe80::1]"
    fresh = mini_lb.add_bootstrap({"text": ["a", "b", "c"]}, "h", 1)["bootstrap_room"]
    assert len(fresh) == 3 and all(0 <= r < 2**63 for r in fresh)


@pytest.mark.timeout(30)
def test_input_logprobs_prefill_first():
    merged = mini_lb.merge_input_logprobs(
        {"meta_info": {"input_token_logprobs": [[-1.0, 7, None], [-2.0, 8, None]]}},
        {"meta_info": {"input_token_logprobs": [[-3.0, 9, None]], "output_token_logprobs": [[-0.5, 1, None]]}},
    )
    assert merged["meta_info"]["input_token_logprobs"] == [[-1.0, 7, None], [-2.0, 8, None], [-3.0, 9, None]]
    assert merged["meta_info"]["output_token_logprobs"] == [[-0.5, 1, None]]


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, json.loads(resp.read() or b"null")


def _post(url, obj):
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.mark.timeout(200)
def test_mini_lb_routes_one_room_to_both_sides(tmp_path):
    prefill_port, decode_port, bootstrap, lb_port = free_ports("127.0.0.1", 4)
    env = {"PYTHONPATH": STANDIN_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    standin = [sys.executable, "-m", "sglang_standin_server", "--model-path", "/models/tiny"]
    opts = cmds.PDOptions(model_path="/models/tiny", prefill_port=prefill_port, decode_port=decode_port,
                          bootstrap_port=bootstrap, router_port=lb_port)
    launcher = Launcher(tmp_path)
    try:
        for mode, port in (("prefill", prefill_port), ("decode", decode_port)):
            launcher.start(ServerSpec(mode, standin + ["--disaggregation-mode", mode, "--port", str(port)],
                                      f"http://127.0.0.1:{port}", port, env))
        launcher.start(cmds.router_spec(opts, sys.executable))
        launcher.wait_healthy(["prefill", "decode", "router"], timeout=90)
        lb = f"http://127.0.0.1:{lb_port}"

        reply = _post(lb + "/generate", {"text": "Question: q\nAnswer:", "sampling_params": {}})
        assert reply["meta_info"]["mode"] == "decode"
        batch = _post(lb + "/generate", {"text": ["a", "b"], "sampling_params": {},
                                         "return_logprob": False})
        assert [r["meta_info"]["mode"] for r in batch] == ["decode", "decode"]
        with_lp = _post(lb + "/generate", {"text": "x", "sampling_params": {}, "return_logprob": True})
        assert with_lp["meta_info"]["input_token_logprobs"] == [[-1.0, 0, "prefill"], [-1.0, 0, "decode"]]

        _, seen_p = _get(f"http://127.0.0.1:{prefill_port}/_standin/requests")
        _, seen_d = _get(f"http://127.0.0.1:{decode_port}/_standin/requests")
        assert len(seen_p) == len(seen_d) == 3
        for p, d in zip(seen_p, seen_d):
            assert p == d  # the same request, bootstrap fields included, reached both sides
        assert seen_p[0]["bootstrap_host"] == "127.0.0.1"
        assert seen_p[0]["bootstrap_port"] == bootstrap
        assert seen_p[0]["bootstrap_room"] == reply["meta_info"]["bootstrap_room"]
        assert seen_p[1]["bootstrap_port"] == [bootstrap, bootstrap]
        assert len(set(seen_p[1]["bootstrap_room"])) == 2

        assert _get(lb + "/get_model_info") == (200, {"model_path": "/models/tiny", "is_generation": True})
        assert _get(lb + "/health_generate")[0] == 200
    finally:
        launcher.stop_all(grace=5)
