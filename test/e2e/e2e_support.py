"""Shared pieces of the GPU end-to-end tests: skip reasons, running the deployment scripts."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from sglang_disagg_ext.deploy.procs import NVIDIA_SMI, gpu_count

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(ROOT / "scripts" / "launch_pd.py")
GSM8K = str(ROOT / "scripts" / "gsm8k.py")
TINY = str(ROOT / "scripts" / "tiny_model.py")

MODEL_ENV = "SGLANG_DISAGG_EXT_E2E_MODEL"
DATA_ENV = "SGLANG_DISAGG_EXT_E2E_GSM8K"
MIN_ACC_ENV = "SGLANG_DISAGG_EXT_E2E_MIN_ACCURACY"
QUESTIONS_ENV = "SGLANG_DISAGG_EXT_E2E_NUM_QUESTIONS"
IB_ENV = "SGLANG_DISAGG_EXT_E2E_IB_DEVICE"


def gpu_skip_reason(needed: int) -> Optional[str]:
    # These tests deploy on CUDA, so only NVIDIA GPUs count here (launch-pd counts AMD GPUs too).
    have, how = gpu_count(tools=(NVIDIA_SMI,))
    if have < needed:
        return f"GPU-only end-to-end test: needs {needed} NVIDIA GPU(s), {have} visible ({how})"
    return None


def sglang_skip_reason() -> Optional[str]:
    if importlib.util.find_spec("sglang") is None:
        return f"end-to-end test of a deployment: SGLang is not installed in {sys.executable}"
    return None


def model_skip_reason() -> Optional[str]:
    model = os.environ.get(MODEL_ENV)
    if not model:
        return f"end-to-end test against a real model: {MODEL_ENV} is not set (a local model folder, e.g. Llama-3.1-8B-Instruct)"
    if not (Path(model) / "config.json").is_file():
        return f"{MODEL_ENV}={model} is not a model folder (no config.json)"
    return None


def nixl_skip_reason() -> Optional[str]:
    if importlib.util.find_spec("nixl") is None:
        return "nixl is not installed (pip install nixl) for the nixl-ext run"
    return None


def run(argv: List[str], timeout: float, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def start_pd(run_dir: Path, model: str, backend: str, extra: List[str], timeout: float = 1200) -> dict:
    argv = [LAUNCH, "start", "--model-path", model, "--backend", backend, "--run-dir", str(run_dir),
            "--timeout", str(timeout - 60), *extra]
    out = run(argv, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"launch_pd start failed ({out.returncode}):\n{out.stderr}")
    return json.loads((run_dir / "run.json").read_text())


def stop_pd(run_dir: Path) -> None:
    if (run_dir / "run.json").exists():
        run([LAUNCH, "stop", "--run-dir", str(run_dir)], timeout=120)
