"""Verified NIXL transfers (``SGLANG_DISAGG_EXT_VERIFY=1``), on real NIXL (UCX over 127.0.0.1).

Injection (the narrowest boundary for an engine that posts transfers from descriptor
lists and completes them later): ``test/support/inflight_flip.py::flip_one_landed_byte``,
a decode manager hook, flips one byte of one landed decode page when the first prefill
rank's Success reaches decode's ``apply_prefill_status``, before SGLang (and ``-ext``'s
check inside ``update_status``) handles it. Stock and ``-ext`` get the same fault at the
same point; ``-ext``'s prefill digest was taken when the transfer was created. The
harness's decode ranks then check every destination byte themselves, independently of
the digest. Stock (and -ext on 0.5.23) registers host memory through the harness's shim
(``harness/nixl_shim.py``); the plugin's F4 classes register it themselves.

* Without verification (stock ``nixl``, ``nixl-ext`` with the switch off) decode
  reports Success and the harness finds the wrong byte (KV in CI, every case with
  ``SGLANG_DISAGG_EXT_ALL_FLIP_SIDES=1``).
* With verification, decode reports Failed naming the component, the decode buffer
  and the prefill rank(s), and the harness finds the flipped byte where it landed:
  KV, the aux row, each state kind, heterogeneous TP 2->1, 1->2, 1->4 (head slices of
  KV and SWA state), a decode pool with an extra draft layer (expected to fail:
  ``NIXL_DRAFT_LAYER``).
* No false alarm: random valid transfers with verification on (page maps, lengths,
  chunking, every state kind at equal TP; paged state kinds across TP sizes), all
  Success, every byte checked by the harness, every room counted as verified.

The digest travels in prefill's status message where the decode learns Success from it
alone (0.5.23), on the room's aux notification where the plugin's F4 classes serve a
decode that concludes from notifications (0.5.10.post1-0.5.12.x; the flip then happens
when stock's ``check_transfer_done`` would conclude); elsewhere the tests are skipped
(``verification.available``).
``SGLANG_DISAGG_EXT_RANDOM_TRANSFERS`` (default 150) sets the random transfers per
run at equal TP (a quarter of it per multi-rank shape).
"""

import os
import random

import pytest
from conftest import required_part

from sglang_disagg_ext import releases, verification
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from support.verify_cases import (
    HEAD_DIM,
    HEADS,
    assert_flip_failed_by_digest,
    assert_flip_unnoticed,
    assert_stock_decode_served,
    counted_ok,
    flip_cases,
    landed_flip_env,
    one_request,
    random_scenario,
    three_rooms,
    two_sided_cases,
)

POLICY = releases.current_policy()
WHY_NOT = verification.available(POLICY)["nixl-ext"]
pytestmark = [
    pytest.mark.engine,
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
    # Also the stock half: the landed-flip hook fires where each release's decode concludes.
    pytest.mark.skipif(bool(WHY_NOT), reason=f"verified NIXL transfers not available here: {WHY_NOT}"),
]

VERIFY = {"SGLANG_DISAGG_EXT_VERIFY": "1"}


# Host memory: the plugin's F4 classes (0.5.10.post1-0.5.12.x) register the harness's CPU pools
# as host memory themselves; stock, and -ext where it composes over stock's manager (0.5.23),
# get the harness's shim (harness/nixl_shim.py).
EXT_NEEDS_SHIM = not POLICY.is_live("F4")


def _shim_env(backend: str) -> dict:
    return {nixl_shim.ENV: "1"} if EXT_NEEDS_SHIM or not backend.endswith("-ext") else {}


def _flip_env(backend: str, component: str, buffer: int, page: int, prefill_tp: int = 1) -> dict:
    return {**_shim_env(backend), **landed_flip_env(component, buffer, page, prefill_tp)}


CASES = {
    **flip_cases("nixl"),
    "kv tp1->4": (lambda: one_request("nixl verify kv tp1->4", 1, 4), "kv", 3, 6, "[0]"),
    "swa tp1->2": (lambda: one_request("nixl verify swa tp1->2", 1, 2, kind="swa"), "state0", 2, 5, "[0]"),
    # Decode's SWA pool has one more (draft) layer: K0 K1 K2 V0 V1 V2; prefill's V of
    # layer 0 belongs in decode buffer 3 (the flip is there), and the reason names the
    # destination buffer (see NIXL_DRAFT_LAYER).
    "swa+draft layer": (lambda: one_request("nixl verify swa +1 layer", kind="swa", extra_layers=1),
                        "state0", 3, 5, "[0]"),
}

# Seen by the harness's byte check once the flip tests looked at it (stock nixl, nixl-ext and
# verified nixl-ext alike, measured on 0.5.11 and 0.5.23, with and without the flip): with a
# decode draft layer NIXL pairs the state buffers by position, so prefill's V0 (buffer 2) lands
# in decode's draft K2 (buffer 2), V1 in decode's V0 (buffer 3), decode's V1 is never written;
# Success on both sides, verified too (the digest follows the same pairing). The verified room
# fails only on the flip. Mooncake pairs by layer (F7); NIXL has no such fix yet.
NIXL_DRAFT_LAYER = pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="NIXL pairs state buffers by position with a decode draft layer: prefill V0 lands in "
    "decode's draft K buffer, Success on both sides (verified too); no fix yet")


def _case_params(cases) -> list:
    return [pytest.param(c, marks=NIXL_DRAFT_LAYER) if c == "swa+draft layer" else c for c in cases]


def _stock_cannot(scn) -> str:
    """Why stock NIXL cannot serve ``scn`` on this release ("" where it can): F4 (up to
    0.5.12.x) is live for every TP-size difference (stock decode never completes, or its bytes
    land at the wrong offsets), F13 (0.5.13-0.5.21) for SWA state across TP sizes (stock raises)."""
    if scn.prefill_tp == scn.decode_tp:
        return ""
    if POLICY.is_live("F4"):
        return "F4 is live (stock's heterogeneous TP is the bug)"
    if scn.state_pools and POLICY.is_live("F13"):
        return "F13 is live (stock refuses SWA state across TP sizes)"
    return ""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["nixl", "nixl-ext"])
@pytest.mark.parametrize("case", _case_params(two_sided_cases(CASES, ("kv",))))
def test_landed_flip_goes_unnoticed_without_verification(case, backend):
    """Stock and unverified ext: Success, and the harness's own byte check finds the flipped byte
    on every decode rank, nothing else wrong. CI runs KV; ``SGLANG_DISAGG_EXT_ALL_FLIP_SIDES=1``
    every case (the landed flip is the same decode-side hook for each)."""
    if case == "dsv4" and NO_DSV4:
        pytest.skip(f"n/a: stock NIXL on SGLang {POLICY.version} serves no DSv4 state (nixl_refuses_dsv4_state)")
    build, component, buffer, page, _ = CASES[case]
    scn = build()
    why = _stock_cannot(scn) if backend == "nixl" else ""
    if why:
        pytest.skip(f"n/a: stock NIXL on SGLang {POLICY.version}: {why}")
    result = run_scenario(scn, backend, extra_env=_flip_env(backend, component, buffer, page, scn.prefill_tp))
    assert_flip_unnoticed(result, scn, component, buffer, page)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", _case_params(CASES))
def test_landed_flip_fails_the_room_with_verification(case):
    if case == "dsv4" and NO_DSV4:
        pytest.skip(f"n/a: stock NIXL on SGLang {POLICY.version} serves no DSv4 state (nixl_refuses_dsv4_state)")
    build, component, buffer, page, ranks = CASES[case]
    scn = build()
    result = run_scenario(scn, "nixl-ext",
                          extra_env={**VERIFY, **_flip_env("nixl-ext", component, buffer, page, scn.prefill_tp)})
    assert_flip_failed_by_digest(result, component, buffer, ranks, prefill_told=True, scn=scn, page=page)


# Stock NIXL up to 0.5.12.x serves mamba, swa and nsa state only (a DSv4 component fails the room).
NO_DSV4 = releases.features().nixl_refuses_dsv4_state
KINDS = tuple(k for k in ("swa", "nsa", "dsv4", "mamba") if not (NO_DSV4 and k == "dsv4"))
# The harness's multi-rank pools: paged state (NSA: see below).
MULTI_RANK_KINDS = tuple(k for k in ("swa", "dsv4") if not (NO_DSV4 and k == "dsv4"))
# The flat layout (0.5.10.post1, 0.5.11) has one state component: a kind per page size.
FLAT = POLICY.layout is releases.StateLayout.FLAT
FLAT_KINDS = {1: ("swa",), 4: ("nsa",)}
# Where stock NIXL's TransferInfo.is_dummy takes a transfer with no decode KV pages and no decode
# prefix for a CP rank's dummy (up to 0.5.22: prefill sends nothing, the room never concludes on
# decode), stock NIXL also fails a room whose SWA/NSA state list is empty (0.5.11: IndexError at
# equal TP sizes, stock's TP error across them), stock and -ext alike. SGLang never asks for either
# (a request with KV pages has window / index-key pages; a full decode-side cache hit carries its
# prefix length), so there the random requests list at least one page each. Up to 0.5.22 a decode
# given state lists that are all empty also waits for a state notification prefill never sends
# (nixl_empty_state_lists_wait; 0.5.20-0.5.22 have no dummy rule, this one shows there).
MIN_PAGES = 1 if (releases.features().nixl_empty_transfer_is_dummy
                  or releases.features().nixl_empty_state_lists_wait) else 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shape", ["tp1 page1", "tp1 page4", "tp2->1", "tp1->2", "tp1->4"])
def test_no_false_alarm_over_random_transfers(shape):
    """Random page maps and lengths (empty included), chunking, aux rows; every state kind
    in one request at equal TP, the paged kinds across TP sizes (head slices of KV and SWA
    state); every request Success and byte-checked by the harness, every room counted as
    verified on every decode rank.

    NSA across TP sizes is left out: there stock NIXL 0.5.23 itself writes pages the
    request did not list and leaves listed ones unwritten, with Success (the harness's
    byte check, verification off), which is not this test's subject."""
    n = int(os.environ.get("SGLANG_DISAGG_EXT_RANDOM_TRANSFERS", "150"))
    equal = shape.startswith("tp1 ")
    p, d = (1, 1) if equal else tuple(int(x) for x in shape[2:].split("->"))
    n = n if equal else max(8, n // 4)
    page_size = 4 if shape == "tp1 page4" else 1
    scenario = random_scenario(random.Random(16 + 7 * p + d + page_size), n, page_size,
                               (FLAT_KINDS[page_size] if FLAT else KINDS) if equal else MULTI_RANK_KINDS,
                               f"nixl verify: {n} random transfers, page size {page_size}, tp{p}->tp{d}",
                               kv_heads=(HEADS, HEAD_DIM), state_heads=(HEADS, HEAD_DIM), prefill_tp=p, decode_tp=d,
                               min_pages=MIN_PAGES)
    result = run_scenario(scenario, "nixl-ext", extra_env={**_shim_env("nixl-ext"), **VERIFY}, timeout_s=max(240, n * 0.8))
    assert result.ok, result.describe()
    assert len(result.requests) == n
    assert all(r.decode_status == "Success" and r.bytes_verified for r in result.requests), result.describe()
    assert counted_ok(result) == [float(n)] * d, result.plugin_metrics


@pytest.mark.timeout(180)
def test_a_verifying_prefill_leaves_a_stock_decode_as_stock():
    """A verifying ``nixl-ext`` prefill with a stock decode: three requests (KV, SWA state, aux),
    every one Success with every byte right; nothing on decode counts a verified room. Where
    the digest rides on the aux notification (0.5.10.post1-0.5.12.x), stock's parser meets the
    extra field and must ignore it; on 0.5.23 it is a trailing status frame. Both sides get
    the harness's host-memory shim here, which the stock decode needs on CPU pools."""
    scn = three_rooms(one_request("nixl verifying prefill, stock decode", kind="swa"))
    result = run_scenario(scn, "nixl-ext", decode_backend="nixl", extra_env={nixl_shim.ENV: "1", **VERIFY})
    assert_stock_decode_served(result)
