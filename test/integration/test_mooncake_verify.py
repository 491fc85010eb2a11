"""Verified Mooncake transfers (``SGLANG_DISAGG_EXT_VERIFY=1``).

Injection (the narrowest boundary): ``test/support/inflight_flip.py`` shadows the
prefill engine's ``batch_transfer_sync`` and flips one byte of the source page
for the length of that one engine call (restored after). Stock and ``-ext``
managers get the same fault at the same call; the ``-ext`` digest was taken in
``_transfer_data``, before the engine call. The harness's decode then checks
every destination byte itself, independently of the digest.

* Without verification (stock ``mooncake``, ``mooncake-ext`` with the switch
  off) decode reports Success and the harness finds the wrong byte: for KV, each
  state kind and the draft layer, and KV at TP 1 -> 2 (the other TP case with
  ``SGLANG_DISAGG_EXT_ALL_FLIP_SIDES=1``).
* With verification, decode reports Failed naming the component and buffer, and
  the harness finds the flipped byte where it landed (the Failed is the flip's).
* No false alarm: many random valid transfers with verification on, all
  Success, every byte checked by the harness, every one counted as verified.

Across TP sizes (2 -> 1, 1 -> 2) the fault is a landed byte instead
(``inflight_flip.flip_one_landed_byte``): there 0.5.23 hands head slices straight
to the engine, where the in-flight hook would flip before the digest reads.

Up to 0.5.19 the digest rides on the fourth status frame of the ``-ext`` peer exchange
(``backends/mooncake/peers``, F6/F9): the same cases run there; where neither is available the
verified cases are skipped (``verification.available``). Where Mooncake's
prefill bootstrap loop takes decode's notices (0.5.22+), decode's mismatch
notice reaches prefill and is counted there.

``SGLANG_DISAGG_EXT_RANDOM_TRANSFERS`` (default 150) sets the random transfers
per page size; CI runs the default, a long run sets e.g. 500 (1,000 in all).
"""

import os
import random

import pytest

from sglang_disagg_ext import releases, verification
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import Timeouts, kv_only, with_state
from support.verify_cases import (
    HEAD_DIM,
    HEADS,
    assert_flip_failed_by_digest,
    assert_flip_unnoticed,
    assert_harness_saw_the_flip,
    assert_stock_decode_served,
    counted_ok,
    flip_cases,
    landed_flip_env,
    metric,
    random_scenario,
    three_rooms,
    two_sided_cases,
)
from support import plugin_metrics

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
HOOK = os.path.join(os.path.dirname(__file__), "..", "support", "inflight_flip.py") + ":flip_one_source_byte"
VERIFY = {"SGLANG_DISAGG_EXT_VERIFY": "1"}
# Flip and stock-decode cases end on checks (Success, or Failed by the digest), never on a
# timeout: SGLang's bounds only end a room that hangs, so they need not be short.
SHORT = Timeouts(request_s=40, sglang_waiting_s=20, sglang_bootstrap_s=20)


WHY_NOT = verification.available(POLICY)["mooncake-ext"]


needs_verify = pytest.mark.skipif(bool(WHY_NOT), reason=f"verified transfers not available here: {WHY_NOT}")


def _flip_env(component: str, buffer: int = 0) -> dict:
    return {
        "SGLANG_HARNESS_PREFILL_HOOK": os.path.abspath(HOOK.rsplit(":", 1)[0]) + ":flip_one_source_byte",
        "SGLANG_HARNESS_FLIP_COMPONENT": component,
        "SGLANG_HARNESS_FLIP_BUFFER": str(buffer),
    }


def _state_case(kind, src, dst):
    return lambda: with_state(f"verify {kind}", kind, src, dst, n_kv_pages=2, timeouts=SHORT)


CASES = {
    # case -> (scenario, component flipped, source buffer flipped, decode buffer and page the
    # flipped byte lands in). The hook flips byte 1 of the first block the engine call reads
    # from that buffer: the block of the request's first source page (kv_only: KV 1-3 -> 5-7,
    # aux row 1 -> 3; with_state: the state lists below).
    "kv": (lambda: kv_only("verify kv", n_pages=3, timeouts=SHORT), "kv", 1, 1, 5),
    "swa": (_state_case("swa", [1, 2, 3], [4, 5, 6]), "state0", 1, 1, 4),
    "nsa": (_state_case("nsa", [1, 2], [7, 3]), "state0", 0, 0, 7),
    "dsv4": (_state_case("dsv4", [5], [2]), "state0", 1, 1, 2),
    "mamba": (_state_case("mamba", [3], [9]), "state0", 1, 1, 9),
    "aux": (lambda: kv_only("verify aux", n_pages=2, timeouts=SHORT), "aux", 0, 0, 3),
    # Decode's SWA pool has one more (draft) layer: prefill's V of layer 0 (its
    # buffer 2 of K0 K1 V0 V1) lands in decode's buffer 3 (K0 K1 K2 V0 V1 V2),
    # and the digest names the destination buffer.
    "swa+draft layer": (lambda: _with_draft_layer(), "state0", 2, 3, 4),
}


def _with_draft_layer():
    scn = with_state("verify swa, decode +1 layer", "swa", [1, 2], [4, 5], n_kv_pages=2, timeouts=SHORT)
    scn.state_pools[0].num_layers = 2
    scn.state_pools[0].decode_extra_layers = 1
    return scn


# Stock has the bug the case rides on where that fix is live: its bytes are wrong without any
# flip (F2: DSv4 state never sent; F7: prefill's V pages land in decode's draft layer).
STOCK_BUG = {"dsv4": "F2", "swa+draft layer": "F7"}
# Two-sided in CI: every state kind and the draft layer (each its own send path through the
# engine call the flip rides on); the aux row's two sides run over TCP below.
TWO_SIDED = ("kv", "swa", "nsa", "dsv4", "mamba", "swa+draft layer")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["mooncake", "mooncake-ext"])
@pytest.mark.parametrize("case", two_sided_cases(CASES, TWO_SIDED))
def test_flipped_byte_goes_unnoticed_without_verification(case, backend):
    """Stock and unverified ext: Success on both sides, and the harness's own byte check finds
    the one flipped byte where it landed, nothing else wrong."""
    build, component, src_buffer, buffer, page = CASES[case]
    if backend == "mooncake" and case in STOCK_BUG and POLICY.is_live(STOCK_BUG[case]):
        pytest.skip(f"n/a: {STOCK_BUG[case]} is live on SGLang {POLICY.version}: stock's bytes are wrong unflipped")
    scn = build()
    assert_flip_unnoticed(run_scenario(scn, backend, extra_env=_flip_env(component, src_buffer)),
                          scn, component, buffer, page)


@needs_verify
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_flipped_byte_fails_the_room_with_verification(case):
    build, component, src_buffer, buffer, page = CASES[case]
    scn = build()
    result = run_scenario(scn, "mooncake-ext", extra_env={**VERIFY, **_flip_env(component, src_buffer)})
    (req,) = result.requests
    assert "_V" in (result.decode_manager or ""), result.describe()
    assert req.decode_status == "Failed", result.describe()
    # The flip did happen, and landed where the harness expects it: the Failed is the flip's.
    assert_harness_saw_the_flip(result, scn, component, buffer, page)
    reason = req.decode_failure_reason or ""
    assert f"digest mismatch in component {component} buffer {buffer} from prefill rank(s) [0]" in reason, reason
    # Prefill had concluded Success before decode checked (it is told afterwards, below).
    assert req.prefill_status == "Success", result.describe()
    assert plugin_metrics.value(result.plugin_metrics["decode"], "sglang_disagg_ext_verify_mismatches_total",
                                component=component) == 1.0, result.plugin_metrics["decode"]
    # Prefill is told (stock's bootstrap loop takes decode's notice from 0.5.22, the -ext
    # prefill's socket filter before): counted there.
    told = plugin_metrics.value(result.plugin_metrics["prefill"], "sglang_disagg_ext_verify_mismatch_reports_total")
    assert told == 1.0, result.plugin_metrics["prefill"]


@needs_verify
@pytest.mark.timeout(120)
def test_a_verifying_prefill_leaves_a_stock_decode_as_stock():
    """A verifying ``mooncake-ext`` prefill with a stock decode: three requests, every one
    Success with every byte right, and the decode's status thread alive throughout (up to
    0.5.19 a fourth status frame would end it: prefill sends the digest only to a decode
    whose registration said it reads one; from 0.5.20 stock's codec ignores a trailing
    frame). Nothing on decode counts a verified room."""
    scn = three_rooms(with_state("verifying prefill, stock decode", "swa", [1, 2], [4, 5], n_kv_pages=2,
                                 timeouts=SHORT))
    assert_stock_decode_served(run_scenario(scn, "mooncake-ext", decode_backend="mooncake", extra_env=VERIFY))


KINDS = ("swa", "nsa", "dsv4", "mamba")
FLAT_KINDS = {1: ("swa",), 4: ("nsa",)}


@needs_verify
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page_size", [1, 4])
def test_no_false_alarm_over_random_transfers(page_size):
    """Random page maps and lengths (empty included), chunking, aux rows, and every
    state kind in one request; every request Success and byte-checked by the harness."""
    n = int(os.environ.get("SGLANG_DISAGG_EXT_RANDOM_TRANSFERS", "150"))
    # The flat layout (0.5.10.post1, 0.5.11) has one state component: a kind per page size.
    kinds = KINDS if POLICY.layout is not releases.StateLayout.FLAT else FLAT_KINDS[page_size]
    scenario = random_scenario(random.Random(16 + page_size), n, page_size, kinds,
                               f"verify: {n} random transfers, page size {page_size}")
    result = run_scenario(scenario, "mooncake-ext", extra_env=VERIFY, timeout_s=max(240, n * 0.5))
    assert result.ok, result.describe()
    assert len(result.requests) == n
    assert all(r.decode_status == "Success" and r.bytes_verified for r in result.requests), result.describe()
    assert plugin_metrics.value(result.plugin_metrics["decode"], "sglang_disagg_ext_verified_transfers_total",
                                result="ok") == float(n), \
        result.plugin_metrics["decode"]


# Across TP sizes 0.5.23's send_kvcache_slice hands head slices straight to the engine (the
# wrapped engine digests them). The landed flip (decode hook, after every prefill rank's
# Success) stands in for the in-flight one there: that hook flips during the engine call,
# after which the wrapper's digest would read the flipped byte.
ACROSS_TP = {k: v for k, v in flip_cases("mooncake").items() if "tp" in k}


# Two-sided in CI: decode TP 2 (each decode rank flips its own copy of the page).
TWO_SIDED_ACROSS_TP = two_sided_cases(ACROSS_TP, ("kv tp1->2",))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, variant", [
    (case, variant) for case in ACROSS_TP for variant in ("mooncake", "mooncake-ext", "mooncake-ext verified")
    if variant.endswith("verified") or case in TWO_SIDED_ACROSS_TP])
def test_landed_flip_across_tp_sizes(case, variant):
    """Stock and unverified ext: Success with the flipped byte on every decode rank (the
    harness's byte check); verified ext: Failed naming the buffer, the flip seen landed."""
    build, component, buffer, page, ranks = ACROSS_TP[case]
    verified = variant.endswith("verified")
    if verified and WHY_NOT:
        pytest.skip(f"n/a: verified transfers not available here: {WHY_NOT}")
    scn = build()
    result = run_scenario(scn, variant.split()[0], extra_env={**(VERIFY if verified else {}),
                                                              **landed_flip_env(component, buffer, page, scn.prefill_tp)})
    if verified:
        assert_flip_failed_by_digest(result, component, buffer, ranks, prefill_told=True, scn=scn, page=page)
    else:
        assert_flip_unnoticed(result, scn, component, buffer, page)


# The aux rows over TCP (SGLang's AUX_DATA messages instead of an engine write), on both sides.
AUX_TCP = {"SGLANG_MOONCAKE_SEND_AUX_TCP": "true"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", ["mooncake", "mooncake-ext", "mooncake-ext verified"])
def test_aux_rows_over_tcp_are_verified(variant):
    """One landed aux byte wrong (decode's row 3 of buffer 0, flipped where decode takes
    prefill's Success) with the rows sent over TCP: stock and unverified ext report Success
    with the wrong byte (the harness's byte check), verified ext Failed naming aux buffer 0.
    Three more rooms with the same TCP path and no fault: every aux row digested and checked."""
    build, component, buffer, page, ranks = flip_cases("mooncake")["aux"]
    verified = variant.endswith("verified")
    if verified and WHY_NOT:
        pytest.skip(f"n/a: verified transfers not available here: {WHY_NOT}")
    backend = variant.split()[0]
    result = run_scenario(build(), backend, extra_env={**AUX_TCP, **(VERIFY if verified else {}),
                                                      **landed_flip_env(component, buffer, page)})
    if verified:
        assert_flip_failed_by_digest(result, component, buffer, ranks, prefill_told=True, scn=build(), page=page)
        clean = run_scenario(three_rooms(build()), backend, extra_env={**AUX_TCP, **VERIFY})
        assert clean.ok and all(r.decode_status == "Success" and r.bytes_verified for r in clean.requests), \
            clean.describe()
        assert counted_ok(clean) == [3.0], clean.plugin_metrics
        return
    assert_flip_unnoticed(result, build(), component, buffer, page)


@needs_verify
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)])
def test_no_false_alarm_across_tp_sizes(p, d):
    """Random KV transfers (page maps, lengths, chunking, aux rows) from prefill TP ``p`` to
    decode TP ``d``: every request Success, byte-checked per rank, counted on every decode rank."""
    n = max(8, int(os.environ.get("SGLANG_DISAGG_EXT_RANDOM_TRANSFERS", "150")) // 4)
    scenario = random_scenario(random.Random(40 + 3 * p + d), n, 1, (), f"verify: {n} random transfers tp{p}->tp{d}",
                               kv_heads=(HEADS, HEAD_DIM), prefill_tp=p, decode_tp=d)
    result = run_scenario(scenario, "mooncake-ext", extra_env=VERIFY, timeout_s=max(240, n * 0.8))
    assert result.ok, result.describe()
    assert all(r.decode_status == "Success" and r.bytes_verified for r in result.requests), result.describe()
    assert counted_ok(result) == [float(n)] * d, result.plugin_metrics


@needs_verify
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["1", "require"])
def test_a_room_without_a_digest_succeeds_unverified_or_fails_closed(mode):
    """A stock ``mooncake`` prefill (no digest) with a verifying ``mooncake-ext`` decode, three
    rooms. ``SGLANG_DISAGG_EXT_VERIFY=1``: every room Success, bytes right (the harness's check),
    counted ``unverified`` on decode, 3 of 3. ``=require`` (fail closed): every room Failed on
    decode with the reason naming the missing digests, counted ``refused_unverified``; prefill,
    stock, concluded Success (it sent its bytes and has no way to hear of a refusal)."""
    scn = three_rooms(with_state(f"no digest, verify={mode}", "swa", [1, 2], [4, 5], n_kv_pages=2, timeouts=SHORT))
    result = run_scenario(scn, "mooncake", decode_backend="mooncake-ext",
                          extra_env={verification.VERIFY_ENV: mode})
    decode = result.plugin_metrics["decode"]
    assert len(result.requests) == 3, result.describe()
    if mode == "1":
        assert all(r.success and r.bytes_verified for r in result.requests), result.describe()
        assert metric(decode, "verified_transfers_total", result="unverified") == 3.0, decode
        assert metric(decode, "verified_transfers_total", result="refused_unverified") == 0.0, decode
        return
    for r in result.requests:
        assert r.decode_status == "Failed" and r.prefill_status == "Success", result.describe()
        assert "verified transfer required (SGLANG_DISAGG_EXT_VERIFY=require)" in (r.decode_failure_reason or ""), \
            result.describe()
        assert "arrived with digests from 0 of 1 prefill rank(s)" in r.decode_failure_reason, result.describe()
    assert metric(decode, "verified_transfers_total", result="refused_unverified") == 3.0, decode
    assert metric(decode, "verified_transfers_total", result="unverified") == 0.0, decode
