"""F19 across two releases: a prefill on the newest SGLang and a decode on an older one, real Mooncake over TCP
and real NIXL over UCX.

Run by ``make mixed`` (CI: the newest release's leg): pytest runs in the newest release's venv, which
is prefill's; decode runs in another release's venv (``SGLANG_DISAGG_EXT_DECODE_PYTHON``), through the
transfer harness (SGLang's real bootstrap server, managers, senders and receivers, CPU tensors as
pools, a real Mooncake TransferEngine). Nothing in SGLang or the plugin is replaced; the harness stands
in for decode's scheduler as everywhere, here for its pending queue
(``Scenario.decode_pending_queue``: each request asks for prefill's parallel info once a second, at
most 15 times, then its receiver is aborted, as ``DecodePreallocQueue._ensure_prefill_info`` does).

Expected values, by hand from the wheels' ``PrefillServerInfo`` and bootstrap answers: the fields a
release added to the answer (always sent in a plain setup) are :data:`ADDED`; the decode lacks every
field added after its release up to prefill's. Stock decode cannot build its ``PrefillServerInfo``
from the answer: an ERROR per try naming the first unknown field, the request aborted after the 15th
try (at least 14 s) with "Aborted by AbortReq.". ``-ext``: the first try refuses the prefill, naming
every unknown field; both requests end Failed on decode at once, one ERROR in all; nothing of decode
is written; decode's ABORT ends each room Failed on prefill, not its bootstrap timeout. Decode makes
each receiver only once prefill has made that room's sender
(``Scenario.decode_waits_for_prefill_sender``): SGLang's ABORT handler drops an ABORT for a room prefill
has no status for yet, and without the wait the second room's ABORT could beat its sender (a CI run
of 995664a, NIXL: that room stayed Bootstrapping).
"""

import os
import subprocess

import pytest
from packaging.version import Version

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from support.pending_queue import nothing_written, pending_queue_scenario

pytestmark = pytest.mark.engine

DECODE_PYTHON = os.environ.get("SGLANG_DISAGG_EXT_DECODE_PYTHON")
PREFILL_RELEASE = releases.installed_sglang_version()
# The answer fields each release added, always sent (dsv41_spec_layout 0.5.21 and kv_layout 0.5.23
# are sent only when set: never here).
ADDED = {"0.5.16": ("enable_dsa_cache_layer_split", "prefill_http_port"), "0.5.22": ("decode_allocation_policy",),
         "0.5.23": ("enable_kv_cache_sharding",)}
STOCK_TRIES, STOCK_RETRY_S = 15, 1.0  # DecodePreallocQueue's, in every wheel
EXT_BOUND_S = 5.0  # the refusal is made at the first try (one HTTP query); the rest is load


def _decode_facts():
    if not DECODE_PYTHON:
        pytest.skip("needs a decode venv of an older release: run through `make mixed`")
    code = ("from sglang_disagg_ext import releases; p = releases.current_policy(); "
            "print(p.version, p.is_live('F19'))")
    out = subprocess.run([DECODE_PYTHON, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    version, live = out.stdout.split()[-2:]
    return version, live == "True"


def _scenario():
    return pending_queue_scenario("prefill newer than decode", request_s=40, decode_waits_for_prefill_sender=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ("mooncake", "mooncake-ext", "nixl", "nixl-ext"))
def test_a_prefill_newer_than_its_decode(backend):
    decode_release, f19_live = _decode_facts()
    assert Version(decode_release) < Version(PREFILL_RELEASE), (decode_release, PREFILL_RELEASE)
    unknown = [f for r, fields in ADDED.items() if Version(decode_release) < Version(r) <= Version(PREFILL_RELEASE)
               for f in fields]
    assert unknown, f"SGLang {decode_release}'s decode knows every field of {PREFILL_RELEASE}'s answer"
    if backend.endswith("-ext") and not f19_live:
        pytest.skip(f"F19 is not live on the decode's SGLang {decode_release}")
    # NIXL: the rig's host-memory shim (harness.nixl_shim) on both sides: 0.5.23's NIXL manager
    # registers its pools as VRAM, which this CPU machine's UCX cannot register.
    env = {nixl_shim.ENV: "1"} if backend.startswith("nixl") else None
    result = run_scenario(_scenario(), backend, decode_python=DECODE_PYTHON, timeout_s=200, extra_env=env)
    assert result.error is None, result.error
    reqs = result.requests
    assert [r.decode_status for r in reqs] == ["Failed", "Failed"], [(r.decode_status, r.decode_failure_reason) for r in reqs]
    assert all(nothing_written(r) for r in reqs), [r.mismatches for r in reqs]
    assert not any(r.thread_errors for r in reqs), [r.thread_errors for r in reqs]
    errors = [line for r in reqs for line in r.decode_log if line.startswith("ERROR")]
    if not backend.endswith("-ext"):
        # Stock prefill never hears of the requests: it ends them by its own bootstrap timeout,
        # unless the harness stopped watching first because decode had ended the room.
        assert all(r.prefill_status in ("Failed", "Bootstrapping") for r in reqs), [r.prefill_status for r in reqs]
        assert all("timed out" in r.prefill_failure_reason for r in reqs if r.prefill_status == "Failed")
        # The bug's signature: each try fails to read the answer, the request ends only after the last.
        assert reqs[0].prefill_status == "Failed", reqs[0].prefill_status  # its 8 s before decode's 14 s
        for r in reqs:
            assert r.decode_seconds >= (STOCK_TRIES - 1) * STOCK_RETRY_S, (r.decode_seconds, r.decode_failure_reason)
            assert r.decode_failure_reason == "Aborted by AbortReq.", r.decode_failure_reason
            tries = [line for line in r.decode_log if f"unexpected keyword argument '{unknown[0]}'" in line]
            assert len(tries) >= STOCK_TRIES - 2, r.decode_log[:3]
        return
    for r in reqs:
        assert r.decode_seconds < EXT_BOUND_S, (r.decode_seconds, r.decode_failure_reason)
        reason = r.decode_failure_reason
        assert f"runs a newer SGLang than this decode (SGLang {decode_release})" in reason, reason
        assert all(f"{field}=" in reason for field in unknown), (unknown, reason)
        assert "upgrade decode before prefill" in reason, reason
    assert len(errors) == 1 and "runs a newer SGLang than this decode" in errors[0], errors
    # -ext decode tells prefill (backends.common.prefill_notice: ABORT, which 0.5.22+ prefills take):
    # prefill ends each room Failed, not by its bootstrap timeout (stock's ABORT handler records no reason).
    assert all(r.prefill_status == "Failed" for r in reqs), [(r.prefill_status, r.prefill_failure_reason) for r in reqs]
    assert not any("timed out" in (r.prefill_failure_reason or "") for r in reqs), [r.prefill_failure_reason for r in reqs]
