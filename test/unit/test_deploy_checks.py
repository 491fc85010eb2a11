"""launch-pd's preflight pieces that need no server: counting GPUs with the vendor tools, and
telling a Hugging Face Hub id from a model path.

The GPU tools (``nvidia-smi``, ``amd-smi``, ``rocm-smi``) cannot exist on this CPU-only
machine, so each test puts stand-in executables (``test/support/gpu_tools.py``) on ``PATH``, and
nothing else, so a real tool on a GPU machine cannot answer instead. They print the documented
output forms with made-up values and fail on any other arguments, so the tests also pin the
arguments gpu_count passes.
"""

import os

import pytest

from sglang_disagg_ext.deploy import launch_pd
from sglang_disagg_ext.deploy.procs import NVIDIA_SMI, count_listed_gpus, gpu_count
from support.gpu_tools import NVIDIA_SMI_L, amd_smi_list, fake_tool, rocm_smi_showid

@pytest.fixture
def tool_dir(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return bin_dir


# ---------------------------------------------------------------- GPU count

@pytest.mark.timeout(60)
def test_no_tool_on_path_names_every_tool_tried(tool_dir):
    assert gpu_count() == (0, "nvidia-smi: not on PATH; amd-smi: not on PATH; rocm-smi: not on PATH")


@pytest.mark.timeout(60)
def test_nvidia_gpus_are_counted_as_before(tool_dir, monkeypatch):
    fake_tool(tool_dir, "nvidia-smi", ["-L"], NVIDIA_SMI_L)
    fake_tool(tool_dir, "amd-smi", ["list"], amd_smi_list(8))  # never asked: nvidia-smi found GPUs
    assert gpu_count() == (2, "nvidia-smi -L lists 2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_count() == (1, "nvidia-smi -L lists 2, CUDA_VISIBLE_DEVICES='1'")


@pytest.mark.timeout(60)
def test_amd_smi_counts_gpu_blocks_not_cpus(tool_dir):
    fake_tool(tool_dir, "amd-smi", ["list"], amd_smi_list(8, with_cpu=True))
    assert gpu_count() == (8, "nvidia-smi: not on PATH; amd-smi list lists 8")


@pytest.mark.timeout(60)
def test_rocm_smi_counts_distinct_gpu_indices(tool_dir):
    fake_tool(tool_dir, "rocm-smi", ["--showid"], rocm_smi_showid(4))
    assert gpu_count() == (4, "nvidia-smi: not on PATH; amd-smi: not on PATH; rocm-smi --showid lists 4")


@pytest.mark.timeout(60)
def test_a_failing_tool_falls_through_to_the_next_and_is_reported(tool_dir):
    # An NVIDIA userland without its driver, and amd-smi failing to initialise, on a ROCm node.
    fake_tool(tool_dir, "nvidia-smi", ["-L"], "NVIDIA-SMI has failed because it couldn't communicate "
              "with the NVIDIA driver.\n", returncode=9)
    fake_tool(tool_dir, "amd-smi", ["list"], "", returncode=1, stderr="AMDSMI_STATUS_INIT_ERROR\n")
    fake_tool(tool_dir, "rocm-smi", ["--showid"], rocm_smi_showid(2))
    have, how = gpu_count()
    assert have == 2
    assert how == ("nvidia-smi -L: exited 9: NVIDIA-SMI has failed because it couldn't communicate with "
                   "the NVIDIA driver.; amd-smi list: exited 1: AMDSMI_STATUS_INIT_ERROR; "
                   "rocm-smi --showid lists 2")


@pytest.mark.timeout(60)
def test_amd_visibility_variables_limit_the_count(tool_dir, monkeypatch):
    fake_tool(tool_dir, "amd-smi", ["list"], amd_smi_list(8))
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "4,5,6,7")
    assert gpu_count() == (3, "nvidia-smi: not on PATH; amd-smi list lists 8, "
                              "HIP_VISIBLE_DEVICES='0,1,2', ROCR_VISIBLE_DEVICES='4,5,6,7'")


@pytest.mark.timeout(60)
def test_nvidia_only_count_ignores_amd_gpus(tool_dir):
    fake_tool(tool_dir, "amd-smi", ["list"], amd_smi_list(8))
    assert gpu_count(tools=(NVIDIA_SMI,)) == (0, "nvidia-smi: not on PATH")


@pytest.mark.timeout(60)
def test_listing_parsers_ignore_everything_but_gpu_lines():
    assert count_listed_gpus("nvidia-smi", NVIDIA_SMI_L + "MIG 1g.10gb Device 0: (UUID: MIG-x)\n") == 2
    assert count_listed_gpus("amd-smi", "WARNING: something\n" + amd_smi_list(3)) == 3
    assert count_listed_gpus("rocm-smi", rocm_smi_showid(0)) == 0
    assert count_listed_gpus("rocm-smi", rocm_smi_showid(3)) == 3


# ---------------------------------------------------------------- model path or Hub id

@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                                  "org_1/model.v2"])
def test_hub_ids_pass_unchanged(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launch_pd.resolve_model_arg(text) == (text, True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["/models/x", "./x", "../x/y", "~/x", "x", "a/b/c", "org/-x", "org/x.git",
                                  "org--a/x", "org/na me", ".hidden/x"])
def test_path_looking_arguments_stay_paths(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model, hub = launch_pd.resolve_model_arg(text)
    assert not hub and os.path.isabs(model)
    assert os.path.normpath(model) == os.path.normpath(os.path.join(tmp_path, os.path.expanduser(text)))


@pytest.mark.timeout(60)
def test_an_existing_folder_shaped_like_a_hub_id_is_a_local_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert launch_pd.resolve_model_arg("org/name") == (str(tmp_path / "org" / "name"), False)
