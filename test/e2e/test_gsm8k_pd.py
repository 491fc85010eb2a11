"""GSM8K through a real 1P1D deployment (mooncake-ext, nixl-ext) vs the same model colocated.

Runs where two NVIDIA GPUs and a local model are present; skipped otherwise
with the reason. Environment:

- ``SGLANG_DISAGG_EXT_E2E_MODEL``: local model folder (required), e.g. Llama-3.1-8B-Instruct.
- ``SGLANG_DISAGG_EXT_E2E_GSM8K``: local GSM8K ``test.jsonl``; unset, SGLang downloads it.
- ``SGLANG_DISAGG_EXT_E2E_MIN_ACCURACY``: default 0.62 (SGLang's own PD test threshold
  for Llama-3.1-8B-Instruct, 200 questions).
- ``SGLANG_DISAGG_EXT_E2E_NUM_QUESTIONS``: default 200.
- ``SGLANG_DISAGG_EXT_E2E_IB_DEVICE``: RDMA device; unset, Mooncake runs over TCP.

Prefill on GPU 0, decode on GPU 1; the colocated reference on GPU 0, run first
(module fixture) and stopped before any PD run. Everything goes through scripts/launch_pd.py and
scripts/gsm8k.py, as an operator would run them.
"""

import json
import os
import sys

import pytest
from conftest import require_or_skip

import e2e_support as e2e

_reason = e2e.sglang_skip_reason() or e2e.model_skip_reason() or e2e.gpu_skip_reason(2)
pytestmark = pytest.mark.skipif(_reason is not None, reason=str(_reason))


def _gsm8k_args(target):
    args = [e2e.GSM8K, *target, "--json", "--num-questions", os.environ.get(e2e.QUESTIONS_ENV, "200")]
    data = os.environ.get(e2e.DATA_ENV)
    args += ["--data-path", data] if data else ["--allow-download"]
    return args


def _accuracy(out):
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["results"]["pd"]["accuracy"]


@pytest.fixture(scope="module")
def colocated_accuracy(tmp_path_factory):
    """The same model as one ordinary server on GPU 0 (before any PD run holds it)."""
    from sglang_disagg_ext.deploy.commands import build_colocated_server
    from sglang_disagg_ext.deploy.procs import Launcher, free_ports

    out = tmp_path_factory.mktemp("colocated")
    (port,) = free_ports("127.0.0.1", 1)
    spec = build_colocated_server(os.environ[e2e.MODEL_ENV], port, sys.executable, tp=1, base_gpu_id=0)
    launcher = Launcher(out / "server")
    try:
        launcher.start(spec)
        launcher.wait_healthy(["colocated"], timeout=1200)
        result = e2e.run(_gsm8k_args(["--url", spec.url]), timeout=3600, cwd=out)
    finally:
        launcher.stop_all()
    return _accuracy(result)


@pytest.mark.timeout(7200)
@pytest.mark.parametrize("backend", ["mooncake-ext", "nixl-ext"])
def test_pd_gsm8k_matches_colocated(backend, colocated_accuracy, tmp_path):
    if backend == "nixl-ext":
        # Every release's venv installs NIXL (requirements/no-deps.txt): a required part.
        require_or_skip("NIXL", e2e.nixl_skip_reason() is None, e2e.nixl_skip_reason() or "")
    ib = os.environ.get(e2e.IB_ENV)
    extra = ["--ib-device", ib] if ib else (["--protocol", "tcp"] if backend == "mooncake-ext" else [])
    run_dir = tmp_path / "run"
    try:
        e2e.start_pd(run_dir, os.environ[e2e.MODEL_ENV], backend, extra)
        pd_acc = _accuracy(e2e.run(_gsm8k_args(["--run-dir", str(run_dir)]), timeout=3600, cwd=tmp_path))
    finally:
        e2e.stop_pd(run_dir)
    threshold = float(os.environ.get(e2e.MIN_ACC_ENV, "0.62"))
    print(f"{backend}: PD accuracy {pd_acc:.3f}, colocated {colocated_accuracy:.3f}")
    assert pd_acc > threshold
    assert abs(pd_acc - colocated_accuracy) <= 0.02
