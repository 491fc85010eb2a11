"""launch_pd as an operator runs it: real processes, real sockets, the installed SGLang.

Where a server has to come up and answer (the happy path, ``stop``, the bounded
health wait), the SGLang server is replaced by ``test/support/sglang_standin``
(a real HTTP server process taking ``sglang.launch_server``'s arguments), started
through launch_pd's own ``--server-module`` option: a real SGLang server cannot
stay up on this CPU-only machine. The router in those tests is the real in-tree
mini load balancer. The "server dies during start" test runs the real
``sglang.launch_server`` (it exits: no accelerator here). The GPU-count tests put stand-ins for
``nvidia-smi``/``amd-smi``/``rocm-smi`` (``test/support/gpu_tools.py``) alone on ``PATH``: the
real tools cannot exist on this CPU-only machine.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from sglang_disagg_ext.deploy.procs import free_ports, gpu_count
from sglang_disagg_ext.releases import installed_sglang_version
from support.gpu_tools import amd_smi_list, fake_tool

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "launch_pd.py")
GSM8K_SCRIPT = str(ROOT / "scripts" / "gsm8k.py")
STANDIN_DIR = str(ROOT / "test" / "support" / "sglang_standin")
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512}


def run_launcher(args, timeout, env_extra=None, cwd=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def standin_env(**extra):
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": STANDIN_DIR + (os.pathsep + path if path else "")}
    env.update(extra)
    return env


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.2)
    return {p: gone(p) for p in pids}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


@pytest.mark.timeout(300)
def test_dry_run_prints_exactly_the_three_commands(tmp_path, model_dir):
    # 0.5.10.post1 has no plugin framework: its servers start through the plugin's launcher.
    module = ("sglang_disagg_ext.launch_server" if installed_sglang_version() == "0.5.10.post1"
              else "sglang.launch_server")
    model = str(model_dir)
    ports = free_ports("127.0.0.1", 4)
    out = run_launcher(["start", "--dry-run", "--model-path", model, "--backend", "nixl-ext",
                        "--prefill-tp", "2", "--decode-tp", "2", "--ib-device", "mlx5_1", "--skip-gpu-check",
                        "--prefill-port", str(ports[0]), "--decode-port", str(ports[1]),
                        "--bootstrap-port", str(ports[2]), "--router-port", str(ports[3]), "--router", "mini-lb"],
                       timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    py = sys.executable

    p, d, b, r = ports

    def server(mode, port, gpu):
        return (f"{py} -m {module} --model-path {model} --disaggregation-mode {mode} "
                f"--disaggregation-bootstrap-port {b} --tp-size 2 --base-gpu-id {gpu} "
                f"--disaggregation-transfer-backend nixl-ext --disaggregation-ib-device mlx5_1 "
                f"--host 127.0.0.1 --port {port}")

    assert out.stdout.splitlines() == [
        server("prefill", p, 0),
        server("decode", d, 2),
        f"{py} -m sglang_disagg_ext.deploy.mini_lb --prefill http://127.0.0.1:{p} {b} "
        f"--decode http://127.0.0.1:{d} --host 127.0.0.1 --port {r}",
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(300)
def test_dry_run_refuses_what_start_would_refuse(tmp_path, model_dir):
    """A dry run is a deployment gate: a missing model folder, or too few GPUs, exits 2 with
    start's message and prints no command."""
    missing = tmp_path / "models" / "absent"
    out = run_launcher(["start", "--dry-run", "--model-path", str(missing), "--skip-gpu-check"], timeout=240)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert f"model path {missing} does not exist" in out.stderr and "nothing was started" in out.stderr
    have, how = gpu_count()
    if have < 2:  # the default 1P1D on GPUs needs two
        out = run_launcher(["start", "--dry-run", "--model-path", str(model_dir)], timeout=240)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
        assert "GPU(s)" in out.stderr and "--skip-gpu-check" in out.stderr, out.stderr


@pytest.mark.timeout(300)
def test_missing_model_path_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    missing = tmp_path / "models" / "absent"
    out = run_launcher(["start", "--model-path", str(missing), "--run-dir", str(run_dir),
                        "--skip-gpu-check"], timeout=240)
    assert out.returncode == 2
    assert f"model path {missing} does not exist" in out.stderr
    assert "nothing was started" in out.stderr
    assert not run_dir.exists()


@pytest.mark.timeout(300)
def test_folder_without_config_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_launcher(["start", "--model-path", str(empty), "--run-dir", str(tmp_path / "run"),
                        "--skip-gpu-check"], timeout=240)
    assert out.returncode == 2
    assert f"model path {empty} has no config.json" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_no_gpu_is_refused_before_anything_starts(tmp_path, model_dir):
    have, how = gpu_count()
    if have >= 2:
        pytest.skip(f"this machine has {have} GPUs ({how}); the refusal needs fewer than 2")
    out = run_launcher(["start", "--model-path", str(model_dir), "--run-dir", str(tmp_path / "run")],
                       timeout=240)
    assert out.returncode == 2
    assert f"the servers need 2 GPU(s) (GPU ids 0..1) but {have}" in out.stderr
    assert f"({how})" in out.stderr  # which tools were asked and what they said
    assert "--skip-gpu-check" in out.stderr
    assert not (tmp_path / "run").exists()


def without_visibility_vars(env_extra):
    env = dict(os.environ)
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        env.pop(var, None)
    env.update(env_extra)
    return env


def run_launcher_env(args, timeout, env, cwd=None):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.mark.timeout(300)
def test_amd_gpus_pass_the_gpu_check_for_mori_ext(tmp_path, model_dir):
    """A mori-ext launch on an AMD node (amd-smi lists the GPUs, no nvidia-smi) passes the GPU
    check without --skip-gpu-check; with one GPU listed it is refused, naming the tools asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_tool(bin_dir, "amd-smi", ["list"], amd_smi_list(2))
    env = without_visibility_vars({"PATH": str(bin_dir)})
    args = ["start", "--dry-run", "--model-path", str(model_dir), "--backend", "mori-ext", "--router", "mini-lb"]
    out = run_launcher_env(args, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and all("--disaggregation-transfer-backend mori-ext" in l for l in lines[:2])
    assert "--base-gpu-id 0 " in lines[0] and "--base-gpu-id 1 " in lines[1]

    fake_tool(bin_dir, "amd-smi", ["list"], amd_smi_list(1))
    out = run_launcher_env(args, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert ("the servers need 2 GPU(s) (GPU ids 0..1) but 1 is visible "
            "(nvidia-smi: not on PATH; amd-smi list lists 1); --skip-gpu-check starts them anyway") in out.stderr

    out = run_launcher_env(args + ["--skip-gpu-check"], timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 3, out.stderr


@pytest.mark.timeout(300)
def test_no_gpu_tool_refusal_names_every_tool_tried(tmp_path, model_dir):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()  # no GPU tool at all
    out = run_launcher_env(["start", "--dry-run", "--model-path", str(model_dir), "--backend", "mori-ext"],
                           timeout=240, env=without_visibility_vars({"PATH": str(bin_dir)}), cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert ("but 0 are visible (nvidia-smi: not on PATH; amd-smi: not on PATH; rocm-smi: not on PATH)"
            in out.stderr), out.stderr


@pytest.mark.timeout(300)
def test_a_hub_id_is_passed_to_sglang_unchanged(tmp_path):
    """A Hugging Face Hub id that is no local path passes the preflight and reaches both servers
    as given; the dry run says SGLang fetches it from the Hub. Nothing is downloaded here."""
    hub_id = "meta-llama/Llama-3.1-8B-Instruct"
    out = run_launcher(["start", "--dry-run", "--model-path", hub_id, "--skip-gpu-check", "--router", "mini-lb"],
                       timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    prefill, decode, _ = out.stdout.splitlines()
    for line in (prefill, decode):
        assert f" --model-path {hub_id} " in line
    assert out.stderr.count("Hugging Face Hub") == 1
    assert (f"model {hub_id} is not a local path: passed unchanged to SGLang, which fetches it from the "
            "Hugging Face Hub") in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("given,refused", [("/models/absent-x", "/models/absent-x"),
                                           ("./absent-x", "{cwd}/absent-x"),
                                           ("~/absent-x", "{home}/absent-x"),
                                           ("nested/absent-x/more", "{cwd}/nested/absent-x/more")])
def test_a_missing_path_is_still_refused(tmp_path, given, refused):
    home = tmp_path / "home"
    home.mkdir()
    out = run_launcher(["start", "--dry-run", "--model-path", given, "--skip-gpu-check"], timeout=240,
                       env_extra={"HOME": str(home)}, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert f"model path {refused.format(cwd=tmp_path, home=home)} does not exist" in out.stderr
    assert "Hugging Face Hub" not in out.stderr


@pytest.mark.timeout(300)
def test_a_local_folder_shaped_like_a_hub_id_stays_local(tmp_path):
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = run_launcher(["start", "--dry-run", "--model-path", "org/name", "--skip-gpu-check"], timeout=240,
                       cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert all(f" --model-path {local} " in l for l in out.stdout.splitlines()[:2])
    assert "Hugging Face Hub" not in out.stderr


@pytest.mark.timeout(300)
def test_taken_port_is_named_and_nothing_starts(tmp_path, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = run_launcher(["start", "--model-path", str(model_dir), "--run-dir", str(tmp_path / "run"),
                            "--skip-gpu-check", "--decode-port", str(port)], timeout=240)
    assert out.returncode == 2
    assert f"port {port} (--decode-port) on 127.0.0.1 is not available: already in use" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(400)
def test_real_server_that_dies_during_start_is_named_and_everything_stops(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    out = run_launcher(["start", "--model-path", str(model_dir), "--run-dir", str(run_dir),
                        "--skip-gpu-check", "--timeout", "300"], timeout=380)
    assert out.returncode == 1, out.stderr
    record = json.loads((run_dir / "run.json").read_text())
    names = [s["name"] for s in record["servers"]]
    assert names == ["prefill", "decode"]  # the router is never started
    died = [s for s in record["servers"]
            if f"the {s['name']} server (pid {s['pid']}) exited with code" in out.stderr]
    assert len(died) >= 1, out.stderr
    log = Path(died[0]["log"])
    assert f"log: {log}" in out.stderr
    assert "No accelerator" in log.read_text()  # what this CPU machine makes SGLang die of
    assert "stopping every process this run started" in out.stderr
    assert wait_gone([s["pid"] for s in record["servers"]], seconds=5) == {
        s["pid"]: True for s in record["servers"]}


@pytest.mark.timeout(200)
def test_health_wait_is_bounded_and_stops_what_started(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    out = run_launcher(["start", "--model-path", str(model_dir), "--run-dir", str(run_dir),
                        "--skip-gpu-check", "--server-module", "sglang_standin_server", "--timeout", "8"],
                       timeout=150, env_extra=standin_env(STANDIN_NEVER_HEALTHY="1"))
    assert out.returncode == 1, out.stderr
    record = json.loads((run_dir / "run.json").read_text())
    p, d = record["servers"]
    assert (f"no answer from /health within 8 s: prefill ({p['url']}, log {p['log']}), "
            f"decode ({d['url']}, log {d['log']})") in out.stderr
    assert wait_gone([p["pid"], d["pid"]], seconds=5) == {p["pid"]: True, d["pid"]: True}


def post_json(url, obj, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def write_gsm8k(path):
    # Four questions; the stand-in decode answers two right, one wrong, one with no number.
    rows = [
        ("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = 7\n#### 7"),
        ("A box holds 12 eggs. How many eggs in 2 boxes?", "12 * 2 = 24\n#### 24"),
        ("Sara reads 5 pages a day for 6 days. How many pages?", "5 * 6 = 30\n#### 30"),
        ("There are 10 birds and 3 fly away. How many remain?", "10 - 3 = 7\n#### 7"),
    ]
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return {rows[0][0]: "3 + 4 = 7. The answer is 7.",
            rows[1][0]: "12 * 2 = 24. The answer is 24.",
            rows[2][0]: "5 + 6 = 11. The answer is 11.",
            rows[3][0]: "Some birds remain."}


@pytest.mark.timeout(300)
def test_start_route_gsm8k_and_stop_exactly_the_recorded_pids(tmp_path, model_dir):
    data = tmp_path / "gsm8k.jsonl"
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps(write_gsm8k(data)))
    run_dir = tmp_path / "run"
    env = standin_env(STANDIN_ANSWERS=str(answers))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
    try:
        out = run_launcher(["start", "--model-path", str(model_dir), "--run-dir", str(run_dir),
                            "--skip-gpu-check", "--server-module", "sglang_standin_server",
                            "--backend", "mooncake-ext", "--timeout", "120"], timeout=200, env_extra=env)
        assert out.returncode == 0, out.stderr
        record = json.loads((run_dir / "run.json").read_text())
        assert [s["name"] for s in record["servers"]] == ["prefill", "decode", "router"]
        pids = [s["pid"] for s in record["servers"]]
        assert not any(gone(p) for p in pids)
        assert f"router URL: {record['router_url']}" in out.stdout
        for s in record["servers"]:
            assert Path(s["log"]).is_file()

        # The router sends one request to both sides with the same bootstrap room.
        reply = post_json(record["router_url"] + "/generate",
                          {"text": "Question: x\nAnswer:", "sampling_params": {"max_new_tokens": 8}})
        assert reply["meta_info"]["mode"] == "decode"
        prefill_url = record["servers"][0]["url"]
        with urllib.request.urlopen(prefill_url + "/_standin/requests", timeout=10) as resp:
            seen = json.loads(resp.read())
        assert seen[-1]["bootstrap_room"] == reply["meta_info"]["bootstrap_room"]

        # SGLang's own few_shot_gsm8k through the router: 2 right of 4, 1 without a number.
        g = subprocess.run([sys.executable, GSM8K_SCRIPT, "--run-dir", str(run_dir), "--data-path", str(data),
                            "--num-questions", "4", "--num-shots", "1", "--parallel", "2", "--json"],
                           capture_output=True, text=True, timeout=200, cwd=tmp_path)
        assert g.returncode == 0, g.stderr
        result = json.loads(g.stdout)
        assert result["module"] == "sglang.test.few_shot_gsm8k"
        assert result["results"]["pd"]["accuracy"] == 0.5
        assert result["results"]["pd"]["invalid"] == 0.25

        stop = run_launcher(["stop", "--run-dir", str(run_dir), "--grace", "10"], timeout=240)
        assert stop.returncode == 0, stop.stderr
        for s in record["servers"]:
            assert f"{s['name']}: stopping pid {s['pid']} (running)" in stop.stdout
        assert wait_gone(pids) == {p: True for p in pids}
        assert not gone(bystander.pid)

        again = run_launcher(["stop", "--run-dir", str(run_dir)], timeout=240)
        assert again.returncode == 0
        assert again.stdout.splitlines() == [f"{s['name']}: pid {s['pid']} had already exited"
                                             for s in record["servers"]]
    finally:
        bystander.kill()
        bystander.wait(timeout=10)
        if (run_dir / "run.json").exists():
            run_launcher(["stop", "--run-dir", str(run_dir), "--grace", "2"], timeout=60)


@pytest.mark.timeout(60)
def test_stop_leaves_a_reused_pid_alone(tmp_path):
    """A recorded PID whose start time differs belongs to someone else now."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        created = psutil.Process(other.pid).create_time()
        (tmp_path / "run.json").write_text(json.dumps({"servers": [
            {"name": "prefill", "pid": other.pid, "create_time": created - 3600.0,
             "url": "http://127.0.0.1:1", "argv": [], "env": {}, "log": "x"}]}))
        out = run_launcher(["stop", "--run-dir", str(tmp_path)], timeout=50)
        assert out.returncode == 0
        assert out.stdout.strip() == f"prefill: pid {other.pid} now belongs to another process; left alone"
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(timeout=10)


@pytest.mark.timeout(60)
def test_stop_without_a_run_record_says_so(tmp_path):
    out = run_launcher(["stop", "--run-dir", str(tmp_path)], timeout=50)
    assert out.returncode == 2
    assert f"{tmp_path / 'run.json'} does not exist" in out.stderr


@pytest.mark.timeout(60)
def test_free_ports_are_distinct_and_bindable():
    ports = free_ports("127.0.0.1", 4)
    assert len(set(ports)) == 4
    # Above Mooncake's handshake range (12000-17999), below the kernel's ephemeral range:
    # SGLang adds 10000 to a server port for its gRPC port (0.5.11), which must stay < 65536.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    many = free_ports("127.0.0.1", 200)
    assert all(20000 <= p < ephemeral_low for p in many), sorted(many)[-5:]
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def _interpreter(tmp_path, name, flags=""):
    """A wrapper that runs this interpreter (another environment's ``bin/python`` in a real upgrade)."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {flags} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.timeout(300)
def test_decode_python_runs_decode_from_another_environment(tmp_path, model_dir):
    """``--decode-python``: decode's command starts with that interpreter (asked for its release by
    running it); prefill and router keep this one. An interpreter that cannot run, or that has no
    plugin, is refused before anything starts, naming the flag."""
    other = _interpreter(tmp_path, "python-other")
    out = run_launcher(["start", "--dry-run", "--device", "cpu", "--model-path", str(model_dir), "--router", "mini-lb",
                        "--decode-python", other], timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    prefill, decode, router = out.stdout.splitlines()
    module = ("sglang_disagg_ext.launch_server" if installed_sglang_version() == "0.5.10.post1"
              else "sglang.launch_server")
    # Each line: extra environment as NAME=value, then the interpreter.
    assert f" {sys.executable} -m {module} " in prefill and "--disaggregation-mode prefill" in prefill
    assert f" {other} -m {module} " in decode and "--disaggregation-mode decode" in decode
    assert router.startswith(f"{sys.executable} -m sglang_disagg_ext.deploy.mini_lb")

    out = run_launcher(["start", "--dry-run", "--model-path", str(model_dir), "--skip-gpu-check",
                        "--prefill-python", str(tmp_path / "missing")], timeout=240, cwd=tmp_path)
    assert out.returncode == 2 and f"--prefill-python {tmp_path / 'missing'}: cannot run it" in out.stderr, out.stderr
    # -S: no site-packages, so neither SGLang nor the plugin can be imported there.
    bare = _interpreter(tmp_path, "python-bare", "-S")
    out = run_launcher(["start", "--dry-run", "--model-path", str(model_dir), "--skip-gpu-check",
                        "--decode-python", bare], timeout=240, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"--decode-python {bare}: cannot read its SGLang release and plugin (ModuleNotFoundError" in out.stderr
    assert not (tmp_path / "runs").exists()
