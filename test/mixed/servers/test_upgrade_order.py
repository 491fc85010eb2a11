"""A rolling upgrade through real servers: prefill and decode on two SGLang releases, ``mooncake-ext``.

Run by ``make mixed`` (CI: the newest release's leg), in one pytest process after the harness
tests of ``test/mixed``: pytest runs in the newest release's venv; the older release's venv is
``SGLANG_DISAGG_EXT_DECODE_PYTHON`` (named for the harness tests, where it always runs decode).
Each pair is started by ``launch-pd start --device cpu`` with ``--prefill-python`` or
``--decode-python`` and SGLang's router, Mooncake over TCP, page size 1 on both servers (the
older release's CPU server serves no other, ``cpu_servers.page_size``).

* Decode upgraded first (prefill on the older release, decode on the newer): served. Every
  prompt's greedy tokens equal a colocated server's on the newer release, and both servers
  count the transfers as successes.
* Prefill upgraded first (prefill on the newer release, decode on the older): refused cleanly by
  decode (F19), which also tells prefill. Every request ends with an HTTP error within a bound
  shorter than one prefill bootstrap timeout per router try; decode logs one ERROR that
  names each field it cannot read (by hand: the fields added to the bootstrap answer after the
  older release, ``test_newer_prefill.ADDED``) and "upgrade decode before prefill"; all three
  processes stay up; decode counts the refusal. Stock's behaviour for the same pair (15 ERRORs and
  an abort per request) is shown by ``test_newer_prefill.py`` on real engines through the harness;
  it is not repeated here, where each stock request costs the router's retries times 15 s.
"""

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_servers as cs  # noqa: E402
from test_newer_prefill import ADDED, DECODE_PYTHON  # noqa: E402

from sglang_disagg_ext import releases  # noqa: E402
from sglang_disagg_ext.core import prefill_notice  # noqa: E402

pytestmark = pytest.mark.engine

NEWER = releases.installed_sglang_version()
PAGE = 1
# SGLang's router tries a request up to six times, and answers a try once prefill ends its side
# too. Decode fails each -ext try at once and tells prefill (backends.common.prefill_notice: ABORT,
# sent again up to SEND_AT_S[-1] = 3 s later), so a try ends within seconds; a prefill never told
# ends each try at its bootstrap timeout, cpu_servers.TIMEOUT_S (10 s: 50 s for five tries).
REFUSED_BOUND_S = 6 * (prefill_notice.SEND_AT_S[-1] + 2.0)
# The plugin's own ERROR line (SGLang's per-request "Decode handshake failed ... with exception
# KVTransferError(...): <reason>" lines carry the reason too).
PLUGIN_REFUSAL = re.compile(r"^\[[^\]]*\] prefill \S+ runs a newer SGLang than this decode", re.M)


def _older_release():
    if not DECODE_PYTHON:
        pytest.skip("needs a venv of an older release: run through `make mixed`")
    out = subprocess.run([DECODE_PYTHON, "-c", "from sglang_disagg_ext import releases as r; "
                          "print(r.installed_sglang_version())"], capture_output=True, text=True, timeout=120,
                         check=True)
    older = out.stdout.split()[-1]
    assert Version(older) < Version(NEWER), (older, NEWER)
    return older


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The colocated reference (newer release) and both upgrade-order pairs, started together."""
    from sglang_disagg_ext.deploy.commands import build_colocated_server
    from sglang_disagg_ext.deploy.procs import Launcher, free_ports

    older = _older_release()
    root = tmp_path_factory.mktemp("upgrade")
    model = root / "tiny"
    done = subprocess.run(cs.CLI + ["tiny-model", str(model), "--with-weights"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    pairs = {
        "decode first": cs.PDPair(root / "decode-first", "mooncake-ext", str(model), page=PAGE,
                                  prefill_python=DECODE_PYTHON),
        "prefill first": cs.PDPair(root / "prefill-first", "mooncake-ext", str(model), page=PAGE,
                                   decode_python=DECODE_PYTHON),
    }
    (port,) = free_ports("127.0.0.1", 1)
    colocated = build_colocated_server(str(model), port, sys.executable, device="cpu",
                                       extra_args=cs.server_flags(PAGE))
    env = cs.server_env()
    colocated.env.update({k: env[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS")})
    launcher = Launcher(root / "colocated")
    errors = []

    def start():
        try:
            cs.start_pairs(list(pairs.values()))
        except AssertionError as exc:
            errors.append(exc)

    try:
        launcher.start(colocated)
        thread = threading.Thread(target=start)
        thread.start()
        launcher.wait_healthy(["colocated"], timeout=600)
        thread.join()
        assert not errors, errors[0]
        yield older, colocated.url, pairs
    finally:
        problems = []
        for pair in pairs.values():
            try:
                pair.stop()
            except AssertionError as exc:
                problems.append(str(exc))
        launcher.stop_all(grace=10)
        left = cs._pids_alive([p.pid for p in launcher.procs.values()])
        assert not left and not problems, f"servers left running: {left} {problems}"


def _info_release(pair, role):
    info = cs.metric_values(cs.get_text(pair.url(role) + "/metrics"), "sglang_disagg_ext_info")
    assert len(info) == 1, info
    return next(iter(info)).split('sglang="', 1)[1].split('"', 1)[0]


@pytest.mark.timeout(900)
def test_decode_upgraded_first_is_served(servers):
    older, colocated_url, pairs = servers
    pair = pairs["decode first"]
    assert (_info_release(pair, "prefill"), _info_release(pair, "decode")) == (older, NEWER)
    before = {role: cs.get_text(pair.url(role) + "/metrics") for role in ("prefill", "decode")}
    for prompt in cs.PROMPTS:
        want = cs.output_ids(colocated_url, prompt)
        got = cs.output_ids(pair.router_url, prompt)
        assert got == want, (f"prefill {older} -> decode {NEWER}, prompt {prompt[:24]!r}: first difference at token "
                             f"{cs._first_difference(got, want)}\nPD        {got}\ncolocated {want}\n"
                             + pair.log_tails())
        # Greedy output that repeats one token would compare equal whatever KV arrived.
        assert len(set(want)) >= 8, want
    time.sleep(1.0)  # decode counts once its scheduler polls the receiver to Success
    for role in ("prefill", "decode"):
        after = cs.get_text(pair.url(role) + "/metrics")
        moved = {outcome: cs.total(after, "sglang_disagg_ext_transfers_total", role=role, outcome=outcome)
                 - cs.total(before[role], "sglang_disagg_ext_transfers_total", role=role, outcome=outcome)
                 for outcome in ("success", "failed")}
        assert moved == {"success": len(cs.PROMPTS), "failed": 0}, (role, moved)
    assert "upgrade decode before prefill" not in pair.log("decode")


@pytest.mark.timeout(900)
def test_prefill_upgraded_first_is_refused(servers):
    older, _, pairs = servers
    pair = pairs["prefill first"]
    assert (_info_release(pair, "prefill"), _info_release(pair, "decode")) == (NEWER, older)
    unknown = [f for r, fields in ADDED.items() if Version(older) < Version(r) <= Version(NEWER) for f in fields]
    assert unknown, f"SGLang {older}'s decode knows every field of {NEWER}'s answer"
    # One request: the router tries it five times, so one ERROR over five refusals shows "one per prefill".
    results = cs.stream(pair.router_url, cs.PROMPTS[:1], concurrency=1, timeout=REFUSED_BOUND_S + 30)
    for status, body, seconds in results:
        # The client's error carries decode's reason (SGLang's router passes decode's message on).
        assert status >= 400 and "upgrade decode before prefill" in str(body), (status, body, pair.log_tails())
        assert seconds < REFUSED_BOUND_S, (seconds, body)
    decode_log = pair.log("decode")
    refusals = [m.group(0) + decode_log[m.end():].split("\n", 1)[0] for m in PLUGIN_REFUSAL.finditer(decode_log)]
    assert len(refusals) == 1, ("one ERROR per prefill", refusals, pair.log_tails())
    handshakes = [line for line in decode_log.splitlines() if line.split("] ", 1)[-1].startswith("Decode handshake")]
    assert len(handshakes) >= 2 and all("upgrade decode before prefill" in h for h in handshakes), \
        handshakes
    assert f"(SGLang {older})" in refusals[0] and "upgrade decode before prefill" in refusals[0], refusals[0]
    assert all(f"{field}=" in refusals[0] for field in unknown), (unknown, refusals[0])
    assert all(pair.alive(name) for name in ("prefill", "decode", "router")), pair.log_tails()
    metrics = cs.get_text(pair.url("decode") + "/metrics")
    assert cs.total(metrics, "sglang_disagg_ext_requests_refused_total", fix="F19") >= 1
    assert cs.get_text(pair.url("decode") + "/health") is not None
    print(f"prefill {NEWER} -> decode {older}: {[(s, str(b)[:100], round(t, 1)) for s, b, t in results]}")
