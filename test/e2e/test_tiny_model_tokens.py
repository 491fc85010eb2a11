"""Greedy tokens of a locally built tiny Llama: 1P1D with mooncake-ext over TCP vs colocated.

Needs one NVIDIA GPU (two: prefill and decode on separate GPUs) and nothing
else: the model folder comes from scripts/tiny_model.py (hand-built tokenizer,
no download). Two weight sources: ``--load-format dummy`` (the issue's recipe;
SGLang seeds every parameter the same way in both deployments) and random
weights written by ``tiny_model.py --with-weights`` (logits far from flat, so a
wrong KV byte changes the tokens). Both deployments get the same server flags;
prompts go one at a time so batch composition is identical.
"""

import json
import sys
import urllib.request

import pytest

import e2e_support as e2e

_reason = e2e.sglang_skip_reason() or e2e.gpu_skip_reason(1)
pytestmark = pytest.mark.skipif(_reason is not None, reason=str(_reason))

PROMPTS = ["Question: 12 * 3?\nAnswer:", "The quick brown fox", "abc abc abc", "0 1 2 3 4 5 6 7 8 9 " * 8]
SAME_FLAGS = ["--mem-fraction-static", "0.3", "--disable-cuda-graph", "--disable-radix-cache",
              "--random-seed", "0", "--skip-server-warmup"]


def generate(url, prompt):
    body = {"text": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    ids = out.get("output_ids") or [entry[1] for entry in out["meta_info"]["output_token_logprobs"]]
    return ids, out["text"]


@pytest.fixture(scope="module", params=["dummy", "weights"])
def tiny_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    argv = [e2e.TINY, str(folder)] + (["--with-weights"] if request.param == "weights" else [])
    done = e2e.run(argv, timeout=300)
    assert done.returncode == 0, done.stderr
    return str(folder), (["--load-format", "dummy"] if request.param == "dummy" else [])


@pytest.mark.timeout(3600)
def test_pd_tokens_equal_colocated(tiny_model, tmp_path):
    from sglang_disagg_ext.deploy.commands import build_colocated_server
    from sglang_disagg_ext.deploy.procs import NVIDIA_SMI, Launcher, free_ports, gpu_count

    folder, load_flags = tiny_model
    flags = load_flags + SAME_FLAGS
    decode_gpu = "1" if gpu_count(tools=(NVIDIA_SMI,))[0] >= 2 else "0"
    run_dir = tmp_path / "pd"
    try:
        record = e2e.start_pd(run_dir, folder, "mooncake-ext",
                              ["--protocol", "tcp", "--decode-base-gpu-id", decode_gpu,
                               "--server-args", " ".join(flags)])
        pd = [generate(record["router_url"], p) for p in PROMPTS]
    finally:
        e2e.stop_pd(run_dir)

    (port,) = free_ports("127.0.0.1", 1)
    spec = build_colocated_server(folder, port, sys.executable, extra_args=flags)
    launcher = Launcher(tmp_path / "colocated")
    try:
        launcher.start(spec)
        launcher.wait_healthy(["colocated"], timeout=900)
        colocated = [generate(spec.url, p) for p in PROMPTS]
    finally:
        launcher.stop_all()

    for prompt, (pd_ids, pd_text), (co_ids, co_text) in zip(PROMPTS, pd, colocated):
        print(f"{prompt[:24]!r}: pd {pd_ids[:12]}... colocated {co_ids[:12]}...")
        assert len(pd_ids) == 32
        assert pd_ids == co_ids, f"first difference at token {next(i for i, (a, b) in enumerate(zip(pd_ids, co_ids)) if a != b)}"
        assert pd_text == co_text
