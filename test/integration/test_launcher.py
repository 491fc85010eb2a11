"""`python -m sglang_disagg_ext.launch_server`: routing in every spawned process, no SGLang edits.

This is the activation path on releases without a plugin framework
(0.5.10.post1); it is exercised on every release. The check spawns a child
with multiprocessing's spawn method, as SGLang starts its scheduler, and reads
which manager class get_kv_class returns in that child.
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

import sglang


def _sglang_tree_digest():
    root = pathlib.Path(sglang.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _check_routing(tiny_model_dir, backend):
    env = dict(os.environ)
    env.pop("SGLANG_DISAGG_EXT_BACKEND", None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "sglang_disagg_ext.launch_server", "--check-routing",
            "--model-path", tiny_model_dir, "--skip-tokenizer-init", "--device", "cpu",
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
        ],
        capture_output=True, text=True, timeout=540, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


@pytest.mark.timeout(600)
def test_launcher_routes_in_spawned_children_without_editing_sglang(tiny_model_dir, policy):
    before = _sglang_tree_digest()
    report = _check_routing(tiny_model_dir, "mooncake-ext")
    assert report["server_args_backend"] == "mooncake"
    expected = (
        "sglang_disagg_ext.backends.mooncake.conn"
        if policy.routes("mooncake")
        else "sglang.srt.disaggregation.mooncake.conn"
    )
    for where in ("launcher", "spawned_child"):
        assert report[where]["selected"] == "mooncake-ext", where
        assert report[where]["classes"]["mooncake"].startswith(expected + "."), (where, report)
    assert _sglang_tree_digest() == before


@pytest.mark.timeout(600)
def test_launcher_with_stock_name_keeps_stock_classes(tiny_model_dir):
    report = _check_routing(tiny_model_dir, "mooncake")
    for where in ("launcher", "spawned_child"):
        assert report[where]["selected"] is None
        assert report[where]["classes"]["mooncake"].startswith("sglang.srt.disaggregation.mooncake.conn.")
