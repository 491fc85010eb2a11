"""The project's ``gsm8k`` command end to end against the router of a real PD pair.

SGLang's own evaluation (``sglang.test.few_shot_gsm8k``) runs against the ``mooncake-ext``
pair's router on six GSM8K-format questions the test writes. A random tiny model scores about
zero, so the test asserts the pipeline instead: the command exits 0 with the metrics it parsed,
every question went through prefill and decode once (the plugin's transfer counters, which also
count the frontend's one prefix request), and the
evaluation's own dump holds every question.
"""

import json
import subprocess

import pytest

import cpu_servers as cs

QUESTIONS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 12 eggs. How many eggs are in 2 boxes?", "12 * 2 = 24\n#### 24"),
    ("Sara reads 5 pages a day for 6 days. How many pages?", "5 * 6 = 30\n#### 30"),
    ("There are 20 birds and 8 fly away. How many are left?", "20 - 8 = 12\n#### 12"),
    ("A pen costs 3 dollars. How much do 9 pens cost?", "3 * 9 = 27\n#### 27"),
    ("Jim has 100 coins and gives away 45. How many remain?", "100 - 45 = 55\n#### 55"),
    ("Ann bakes 4 trays of 6 cookies. How many cookies?", "4 * 6 = 24\n#### 24"),
    ("A train goes 60 miles an hour for 3 hours. How far?", "60 * 3 = 180\n#### 180"),
]
SHOTS = 2
ASKED = 6


@pytest.mark.timeout(900)
def test_gsm8k_runs_through_the_router(mooncake_pairs, tmp_path):
    deployment = mooncake_pairs
    pair = deployment.pairs["mooncake-ext"]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    before = {n: cs.get_text(pair.url(n) + "/metrics") for n in ("prefill", "decode")}
    done = subprocess.run(
        cs.CLI + ["gsm8k", "--run-dir", str(pair.run_dir), "--data-path", str(data), "--num-questions", str(ASKED),
                  "--num-shots", str(SHOTS), "--parallel", "2", "--max-new-tokens", "16", "--json",
                  "--timeout", "600"],
        capture_output=True, text=True, timeout=700, env=pair.env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    pd = out["results"]["pd"]
    assert out["module"] == "sglang.test.few_shot_gsm8k"
    assert 0.0 <= pd["accuracy"] <= 1.0 and 0.0 <= pd["invalid"] <= 1.0 and pd["latency_s"] > 0
    for name in ("prefill", "decode"):
        after = cs.get_text(pair.url(name) + "/metrics")
        moved = (cs.total(after, "sglang_disagg_ext_transfers_total", outcome="success")
                 - cs.total(before[name], "sglang_disagg_ext_transfers_total", outcome="success"))
        # SGLang's frontend sends the few-shot prefix once first (sglang/lang/interpreter.py
        # cache_program: a prefix longer than 64 characters, max_new_tokens 0), then one
        # request per question.
        assert moved == ASKED + 1, f"{name}: {moved} transfers for {ASKED} questions and the prefix"
    dump = (pair.run_dir / "gsm8k-pd" / "tmp_output_gsm8k.txt").read_text()
    for question, _ in QUESTIONS[:ASKED]:
        assert question in dump
    for question, _ in QUESTIONS[ASKED:]:
        assert dump.count(question) == 0
