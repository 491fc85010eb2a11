"""scripts/gsm8k.py: data-file checks, reading run_eval's metrics, failure paths, PD vs colocated comparison.

The PD-vs-colocated comparison runs SGLang's real ``sglang.test.few_shot_gsm8k.run_eval``
against two stand-in servers (``test/support/sglang_standin``, real HTTP server
processes) with canned answers, so that the two accuracies differ by a known amount,
which a random-weight model cannot give (it scores about zero on both sides). Expected
metrics are counted by hand from the canned answers. The command against real SGLang
servers and their router: test/servers/test_gsm8k_pipeline.py (``make e2e``).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_disagg_ext.deploy import DeployError
from sglang_disagg_ext.deploy import gsm8k
from sglang_disagg_ext.deploy.commands import ServerSpec
from sglang_disagg_ext.deploy.procs import Launcher, free_ports

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "gsm8k.py")
STANDIN_DIR = str(ROOT / "test" / "support" / "sglang_standin")

def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.timeout(30)
def test_data_file_is_checked_line_by_line(tmp_path):
    good = {"question": "1+1?", "answer": "#### 2"}
    assert gsm8k.check_data_file(write_rows(tmp_path / "ok.jsonl", [good] * 3), num_shots=2) == 3
    with pytest.raises(DeployError, match=r"--data-path .*absent.jsonl: no such file"):
        gsm8k.check_data_file(str(tmp_path / "absent.jsonl"), 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DeployError, match=r"bad.jsonl:2: not a JSON line"):
        gsm8k.check_data_file(str(bad), 1)
    with pytest.raises(DeployError, match=r"nokey.jsonl:1: needs string fields 'question' and 'answer'"):
        gsm8k.check_data_file(write_rows(tmp_path / "nokey.jsonl", [{"question": "q"}]), 1)
    with pytest.raises(DeployError, match=r"nonum.jsonl:1: the answer holds no number"):
        gsm8k.check_data_file(write_rows(tmp_path / "nonum.jsonl", [{"question": "q", "answer": "none"}]), 1)
    with pytest.raises(DeployError, match=r"few.jsonl: 1 question\(s\), fewer than --num-shots 5"):
        gsm8k.check_data_file(write_rows(tmp_path / "few.jsonl", [good]), 5)


@pytest.mark.timeout(30)
def test_run_evals_returned_metrics_are_read(tmp_path):
    # The child writes run_eval's returned dict as JSON (numpy floats made floats).
    result = tmp_path / "metrics.json"
    result.write_text(json.dumps({"accuracy": 0.765, "invalid": 0.005, "latency": 31.25, "output_throughput": 1234.567}))
    assert gsm8k.read_result(result, "") == {
        "accuracy": 0.765, "invalid": 0.005, "latency_s": 31.25, "output_throughput": 1234.567}
    result.write_text(json.dumps({"accuracy": 0.5, "latency": 2.0}))
    assert gsm8k.read_result(result, "") == {"accuracy": 0.5, "invalid": None, "latency_s": 2.0,
                                             "output_throughput": None}


@pytest.mark.timeout(30)
def test_no_metrics_is_an_error_showing_the_tail(tmp_path):
    with pytest.raises(DeployError) as err:
        gsm8k.read_result(tmp_path / "absent.json", "Traceback (most recent call last):\nConnectionError: boom\n")
    assert "run_eval returned no metrics" in str(err.value) and "ConnectionError: boom" in str(err.value)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"invalid": 0.0}))
    with pytest.raises(DeployError, match=r"returned no accuracy / latency; it returned \['invalid'\]"):
        gsm8k.read_result(partial, "")


@pytest.mark.timeout(30)
def test_eval_command_calls_sglangs_run_eval_with_its_own_options(tmp_path):
    o = gsm8k.EvalOptions("/data/test.jsonl", num_questions=50, num_shots=3, parallel=8, max_new_tokens=256)
    argv = gsm8k.eval_command("py", "http://10.0.0.5:8000", o, tmp_path / "m.json")
    assert argv[:2] == ["py", "-c"] and argv[4] == str(tmp_path / "m.json")
    assert "from sglang.test.few_shot_gsm8k import run_eval" in argv[2]
    # Every field few_shot_gsm8k's run_eval reads, as `python -m sglang.test.few_shot_gsm8k
    # --host 10.0.0.5 --port 8000 --num-questions 50 --num-shots 3 --parallel 8
    # --max-new-tokens 256 --data-path /data/test.jsonl` sets them.
    assert json.loads(argv[3]) == {"host": "10.0.0.5", "port": 8000, "data_path": "/data/test.jsonl",
                                   "num_questions": 50, "num_shots": 3, "parallel": 8,
                                   "max_new_tokens": 256, "temperature": 0.0}
    assert gsm8k.eval_args("https://lb.example:443/", o)["host"] == "https://lb.example"
    assert gsm8k.eval_args("http://[::1]:8001", o)["host"] == "[::1]"
    with pytest.raises(DeployError, match="is not an http"):
        gsm8k.split_url("127.0.0.1:8000")


@pytest.mark.timeout(30)
def test_difference_and_table():
    pd = {"accuracy": 0.75, "invalid": 0.0, "latency_s": 10.0, "output_throughput": 500.0}
    colo = {"accuracy": 0.8, "invalid": 0.25, "latency_s": 8.0, "output_throughput": None}
    diff = gsm8k.compare(pd, colo)
    assert diff["accuracy"] == pytest.approx(-0.05)
    assert diff["invalid"] == pytest.approx(-0.25)
    assert diff["latency_s"] == pytest.approx(2.0)
    assert diff["output_throughput"] is None
    assert gsm8k.format_table({"pd": pd, "colocated": colo}, diff).splitlines() == [
        "target      accuracy  invalid  latency_s  output_tok/s",
        "pd             0.750    0.000     10.000         500.0",
        "colocated      0.800    0.250      8.000             -",
        "pd - colo     -0.050   -0.250      2.000             -",
    ]


def run_script(args, timeout=120, cwd=None):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.timeout(120)
def test_no_server_listening_is_a_clear_error(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 1"}] * 5)
    (port,) = free_ports("127.0.0.1", 1)
    out = run_script(["--url", f"http://127.0.0.1:{port}", "--data-path", data, "--connect-timeout", "3"],
                     cwd=tmp_path)
    assert out.returncode == 2
    assert f"no SGLang server answers at http://127.0.0.1:{port}" in out.stderr
    assert "Connection refused" in out.stderr


@pytest.mark.timeout(120)
def test_server_that_never_answers_fails_after_the_connect_timeout(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 1"}] * 5)
    with socket.socket() as silent:  # accepts connections (backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        out = run_script(["--url", f"http://127.0.0.1:{port}", "--data-path", data, "--connect-timeout", "2"],
                         cwd=tmp_path)
    assert out.returncode == 2
    assert f"no SGLang server answers at http://127.0.0.1:{port}" in out.stderr
    assert "timed out" in out.stderr


@pytest.mark.timeout(60)
def test_no_data_file_and_no_download_permission(tmp_path):
    out = run_script(["--url", "http://127.0.0.1:9"], cwd=tmp_path)
    assert out.returncode == 2
    assert "give --data-path (a local GSM8K test.jsonl) or --allow-download" in out.stderr


@pytest.mark.timeout(300)
def test_pd_vs_colocated_difference_through_sglang_few_shot(tmp_path):
    rows = [
        {"question": "What is 2 plus 2?", "answer": "#### 4"},
        {"question": "What is 3 times 3?", "answer": "#### 9"},
        {"question": "What is 10 minus 4?", "answer": "#### 6"},
        {"question": "What is 8 divided by 2?", "answer": "#### 4"},
    ]
    data = write_rows(tmp_path / "d.jsonl", rows)
    # "pd" side: 3 of 4 right; "colocated" side: 4 of 4 right.
    pd_answers = {"What is 2 plus 2?": "It is 4", "What is 3 times 3?": "It is 9",
                  "What is 10 minus 4?": "It is 6", "What is 8 divided by 2?": "It is 5"}
    colo_answers = dict(pd_answers, **{"What is 8 divided by 2?": "It is 4"})
    (tmp_path / "pd.json").write_text(json.dumps(pd_answers))
    (tmp_path / "colo.json").write_text(json.dumps(colo_answers))

    pythonpath = STANDIN_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")
    launcher = Launcher(tmp_path / "servers")
    try:
        urls = {}
        for name, answers in (("pd", "pd.json"), ("colo", "colo.json")):
            (port,) = free_ports("127.0.0.1", 1)
            spec = ServerSpec(name, [sys.executable, "-m", "sglang_standin_server", "--port", str(port)],
                              f"http://127.0.0.1:{port}", port,
                              env={"PYTHONPATH": pythonpath, "STANDIN_ANSWERS": str(tmp_path / answers)})
            launcher.start(spec)
            urls[name] = spec.url
        launcher.wait_healthy(["pd", "colo"], timeout=60)
        out = run_script(["--url", urls["pd"], "--colocated-url", urls["colo"], "--data-path", data,
                          "--num-questions", "4", "--num-shots", "2", "--parallel", "2"],
                         timeout=250, cwd=tmp_path)
    finally:
        launcher.stop_all(grace=5)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "GSM8K via sglang.test.few_shot_gsm8k: 4 questions, 2 shots"
    assert lines[2].split()[:3] == ["pd", "0.750", "0.000"]
    assert lines[3].split()[:3] == ["colocated", "1.000", "0.000"]
    assert lines[4].split()[:5] == ["pd", "-", "colo", "-0.250", "0.000"]
    assert (tmp_path / "runs").is_dir()  # run_eval's dump went to the run folder, not the cwd root
