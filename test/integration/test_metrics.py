"""The plugin's Prometheus metrics: counted where transfers happen, served the way SGLang serves its own.

The first test runs a real transfer (two harness processes, SGLang's managers,
the real Mooncake engine over TCP, CPU pools) and reads each process's
``sglang_disagg_ext_*`` metrics back with ``prometheus_client``'s parser; the
expected counts are the ones the scenario implies, worked out by hand (one
trim, one refusal or one thread recovery, by what the release has live). The
second shows the multiprocess path SGLang's ``/metrics`` uses: a child process
with ``PROMETHEUS_MULTIPROC_DIR`` set counts, and a ``MultiProcessCollector``
over that directory (what SGLang's HTTP server builds) reports it.
"""

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from sglang_disagg_ext import __version__, build_info, releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import with_state
from sglang_disagg_ext.selftest.scenarios.isolation import SCENARIOS as ISOLATION
from sglang_disagg_ext.selftest.scenarios.thread_survival import SCENARIOS as THREAD_FAULTS
from support.plugin_metrics import SGLANG_LABELS

POLICY = releases.current_policy()
PREFILL_FAULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support",
                              "prefill_faults.py")
STATE_CLASSES = POLICY.is_live("F1") or POLICY.is_live("F2")


def _samples(text: str, sglang_labels=None):
    """{(sample name, sorted labels): value} from Prometheus text. With ``sglang_labels`` (a
    dict): every sample must carry exactly those of SGLang's labels, which the keys then leave out."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            if sglang_labels is not None:
                assert {k: labels.pop(k) for k in SGLANG_LABELS if k in labels} == sglang_labels, (s.name, s.labels)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def _info(samples, backend: str):
    fixes = ",".join(POLICY.active_fixes())
    key = ("sglang_disagg_ext_info", tuple(sorted(
        {"version": __version__, "commit": build_info.commit(), "backend": backend, "sglang": POLICY.version,
         "fixes": fixes}.items())))
    return samples.get(key)


@pytest.mark.engine
@pytest.mark.timeout(400)
@pytest.mark.skipif(not POLICY.routes("mooncake"), reason=f"mooncake-ext is stock on SGLang {POLICY.version}")
def test_a_real_transfer_exports_what_it_did():
    if STATE_CLASSES:
        # Prefill sends 5 SWA pages, decode allocated 3: the plugin trims once, on prefill.
        result = run_scenario(with_state("metrics: one trim", "swa", [1, 2, 3, 4, 5], [6, 7, 8]), "mooncake-ext")
        assert result.ok, result.describe()
        want = ("sglang_disagg_ext_state_trims_total", (("component", "0"), ("kind", "swa")))
    elif POLICY.is_live("F6"):
        # F6: one request with a KV page outside decode's pool, refused on prefill; three good ones.
        builtin = ISOLATION[0]
        result = run_scenario(builtin.build(POLICY), "mooncake-ext")
        assert builtin.evaluate(result), result.describe()
        want = ("sglang_disagg_ext_requests_refused_total", (("fix", "F6"), ("reason", "kv index out of pool")))
    else:
        # F8 (0.5.12.x: no trim code, F6 not covered): the test-only hook makes send_aux raise
        # once on the transfer worker; the plugin fails that room and re-enters the loop once.
        builtin = THREAD_FAULTS[0]
        env = {"SGLANG_HARNESS_PREFILL_HOOK": f"{PREFILL_FAULTS}:{builtin.prefill_hook}"}
        result = run_scenario(builtin.build(POLICY), "mooncake-ext", extra_env=env)
        assert builtin.evaluate(result), result.describe()
        want = ("sglang_disagg_ext_thread_recoveries_total", (("role", "prefill"), ("thread", "transfer_worker")))
    # SGLang's labels, as the harness's SGLang managers hold them (one rank each, no pipeline;
    # the harness sets kv_args.system_dp_rank = 0, where a server without DP has None and no
    # dp_rank label). The model name is SGLang's resolved one where the harness's SGLang has
    # resolved it (the same on both sides, or on neither); test/servers compares every label,
    # the model name included, with SGLang's own series on a real server's /metrics.
    model = _model_name(result.plugin_metrics["prefill"])
    assert model == _model_name(result.plugin_metrics["decode"])
    named = {"model_name": model} if model else {}
    prefill = _samples(result.plugin_metrics["prefill"],
                       {**named, "engine_type": "prefill", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"})
    decode = _samples(result.plugin_metrics["decode"],
                      {**named, "engine_type": "decode", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"})
    assert prefill.get(want) == 1.0, result.plugin_metrics["prefill"]
    assert want not in decode, result.plugin_metrics["decode"]
    # Every request's transfer counted once per side, by outcome (both outcomes exist from the start).
    for role, side in (("prefill", prefill), ("decode", decode)):
        outcomes = {dict(k[1])["outcome"]: v for k, v in side.items() if k[0] == "sglang_disagg_ext_transfers_total"}
        assert outcomes == {"success": float(sum(r.ok for r in result.requests)),
                            "failed": float(sum(not r.ok for r in result.requests))}, (role, outcomes)
        durations = [v for k, v in side.items() if k[0] == "sglang_disagg_ext_transfer_duration_seconds_count"]
        assert durations == [float(len(result.requests))], (role, durations)
    # Nothing else counted: no refusal, recovery or trim beyond the one implied.
    counted = {k: v for k, v in prefill.items()
               if k[0].endswith("_total") and v and k[0] != "sglang_disagg_ext_transfers_total"}
    assert counted == {want: 1.0}, counted
    for side in (prefill, decode):
        assert _info(side, "mooncake-ext") == 1.0, side


def _model_name(text: str) -> str:
    names = {s.labels.get("model_name") for family in text_string_to_metric_families(text) for s in family.samples}
    assert len(names) == 1, names
    return names.pop()


_CHILD = """
from sglang_disagg_ext import metrics
metrics.count("state_trims_total", component=0, kind="swa")
metrics.count("state_trims_total", component=0, kind="swa")
metrics.count("thread_recoveries_total", role="prefill", thread="transfer_worker")
metrics.set_info("1.2.3", "mooncake-ext", "0.5.x", ["F6", "F7"])
"""


def _served_by_sglang(tmp_path, child: str):
    """Run ``child`` with ``PROMETHEUS_MULTIPROC_DIR`` set, then read that directory back the way
    SGLang's HTTP server does (a ``MultiProcessCollector``): the samples it would serve."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    return _samples(generate_latest(registry).decode())


@pytest.mark.timeout(60)
def test_counts_reach_the_multiprocess_directory_sglang_serves(tmp_path):
    samples = _served_by_sglang(tmp_path, _CHILD)
    assert samples[("sglang_disagg_ext_state_trims_total", (("component", "0"), ("kind", "swa")))] == 2.0
    assert samples[("sglang_disagg_ext_thread_recoveries_total",
                    (("role", "prefill"), ("thread", "transfer_worker")))] == 1.0
    info = [v for (name, labels), v in samples.items() if name == "sglang_disagg_ext_info"]
    assert info == [1.0], samples
    assert any(dict(labels).get("fixes") == "F6,F7" for (name, labels) in samples if name == "sglang_disagg_ext_info")


_LABELLED_CHILD = """
from sglang_disagg_ext import metrics
assert metrics.set_process_labels({"model_name": "tiny", "engine_type": "decode", "tp_rank": "1", "pp_rank": "0",
                                   "team": "kv", "backend": "an extra label that loses to the plugin's own"})
metrics.zero_transfer_series("mooncake-ext", "decode")
metrics.transfer_done("mooncake-ext", "decode", "success", 0.02)
metrics.count("retract_offloads_total")
metrics.count("state_trims_total", component=0, kind="swa")
metrics.set_info("1.2.3", "mooncake-ext", "0.5.x", ["F6"])
# Series exist now: their label names cannot change, so later labels are refused.
assert not metrics.set_process_labels({"model_name": "other"})
"""


@pytest.mark.timeout(60)
def test_every_series_carries_sglangs_labels(tmp_path):
    """SGLang's scheduler labels given to the process reach every series, on the path SGLang's
    ``/metrics`` serves; an extra label named like one of the plugin's own (``backend``) is left out."""
    samples = _served_by_sglang(tmp_path, _LABELLED_CHILD)
    sglang = {"model_name": "tiny", "engine_type": "decode", "tp_rank": "1", "pp_rank": "0", "team": "kv"}
    names = set()
    for name, labels in samples:
        labels = dict(labels)
        names.add(name)
        assert {k: labels.get(k) for k in sglang} == sglang, (name, labels)
        assert labels.get("backend") in (None, "mooncake-ext"), (name, labels)
    # Written by hand: the series the child touched (counters, the histogram's parts, the info gauge).
    assert {"sglang_disagg_ext_transfers_total", "sglang_disagg_ext_transfer_duration_seconds_count",
            "sglang_disagg_ext_retract_offloads_total", "sglang_disagg_ext_state_trims_total",
            "sglang_disagg_ext_info"} <= names, names
    assert samples[("sglang_disagg_ext_transfers_total", tuple(sorted(
        {**sglang, "backend": "mooncake-ext", "role": "decode", "outcome": "failed"}.items())))] == 0.0
    assert samples[("sglang_disagg_ext_transfers_total", tuple(sorted(
        {**sglang, "backend": "mooncake-ext", "role": "decode", "outcome": "success"}.items())))] == 1.0
