"""Verified MoRI transfers (``SGLANG_DISAGG_EXT_VERIFY=1``), every supported release
(CI: 0.5.10.post1, 0.5.11, 0.5.12.post1 with F3's classes, 0.5.23).

MoRI's engine needs its RDMA stack, which this machine does not have: both sides run
SGLang's real MoRI managers over the MoRI stand-in (``test/support/mori_standin``, the
narrowest replacement: MoRI's ``IOEngine`` API over host memcpy and TCP; metadata rows
through the engine, ``aux_rdma``), as every MoRI test here does. Nothing of the code under
test is replaced.

Injection: ``test/support/inflight_flip.py::flip_one_landed_byte`` (decode manager hook):
one byte of one landed decode page flipped when prefill's Success reaches decode's
``apply_prefill_status``, before SGLang (and ``-ext``'s check inside ``update_status``)
handles it; the same fault for stock and ``-ext``. The harness checks every destination
byte itself.

* Stock ``mori`` and unverified ``mori-ext``: Success with the wrong byte (KV in CI, every
  case with ``SGLANG_DISAGG_EXT_ALL_FLIP_SIDES=1``).
* Verified ``mori-ext``: Failed naming component, decode buffer and prefill rank(s), and the
  harness finds the flipped byte where it landed, for KV, the aux row, each state kind,
  TP 2->1 and 1->2 (KV). MoRI sends no hybrid state
  before 0.5.12 (F3 n/a): there the state cases are n/a.
* No false alarm: random valid transfers (every state kind at equal TP where MoRI sends
  state; KV across TP sizes, where stock MoRI refuses SWA state), all Success and
  byte-checked, all counted.

MoRI's prefill bootstrap loop never offers decode's messages to ``_handle_abort_notification``:
the ``-ext`` prefill takes decode's mismatch notice through its own socket filter, so prefill is
told (and counts it) on every release.
"""

import os
import random

import pytest
from conftest import required_part

from sglang_disagg_ext import releases, verification
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios import mori as selftest_mori
from support.verify_cases import (
    HEAD_DIM,
    HEADS,
    assert_flip_failed_by_digest,
    assert_stock_decode_served,
    assert_flip_unnoticed,
    counted_ok,
    flip_cases,
    landed_flip_env,
    random_scenario,
    three_rooms,
    two_sided_cases,
)

POLICY = releases.current_policy()
WHY_NOT = verification.available(POLICY)["mori-ext"]
pytestmark = [
    pytest.mark.engine,
    required_part("the MoRI stand-in", selftest_mori.standin_dir() is not None, "test/support/mori_standin is missing"),
    pytest.mark.skipif(bool(WHY_NOT), reason=f"verified MoRI transfers not available here: {WHY_NOT}"),
]

VERIFY = {"SGLANG_DISAGG_EXT_VERIFY": "1"}
# MoRI's hybrid-state send arrived in 0.5.12 (F3); before it a request's state is never sent.
NO_STATE = POLICY.fixes.get("F3") is releases.FixStatus.NA


def _env(**extra) -> dict:
    env = dict(selftest_mori.standin_env(aux_rdma=True))
    env.update(extra)
    return env


def _flip_env(component: str, buffer: int, page: int, prefill_tp: int = 1) -> dict:
    return _env(**landed_flip_env(component, buffer, page, prefill_tp))


CASES = flip_cases("mori")

# releases.features().mori_unique_prefill_rank, read by hand: MoriKVManager defines both
# _compute_prefill_unique_rank and _connect_threadsafe (0.5.12.post1 mori/conn.py:530, :421;
# 0.5.16 :637, :460; 0.5.19 :839, :615); 0.5.10.post1/0.5.11 neither (the status message's rank is
# attn_tp_rank * pp_size + pp_rank, :411); 0.5.20-0.5.23 only _connect_threadsafe (no own message).
UNIQUE_RANK = {"0.5.10.post1": False, "0.5.11": False, "0.5.12.post1": True, "0.5.16": True, "0.5.19": True,
               "0.5.20": False, "0.5.21": False, "0.5.22": False, "0.5.23": False}


@pytest.mark.timeout(30)
def test_status_message_rank_probe_matches_the_wheel_read_by_hand():
    """The probe the verifying prefill's own status message (up to 0.5.19) rests on for the rank
    it names and the socket it sends on; it reads the source (no MoRI engine needed)."""
    if POLICY.version not in UNIQUE_RANK:
        pytest.skip(f"n/a: not read by hand for SGLang {POLICY.version}")
    assert releases.features().mori_unique_prefill_rank is UNIQUE_RANK[POLICY.version]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["mori", "mori-ext"])
@pytest.mark.parametrize("case", two_sided_cases(CASES, ("kv",)))
def test_landed_flip_goes_unnoticed_without_verification(case, backend):
    """Stock and unverified ext: Success, and the harness's own byte check finds the flipped byte
    on every decode rank, nothing else wrong. CI runs KV; ``SGLANG_DISAGG_EXT_ALL_FLIP_SIDES=1``
    every case (the landed flip is the same decode-side hook for each)."""
    build, component, buffer, page, _ = CASES[case]
    if NO_STATE and component.startswith("state"):
        pytest.skip(f"n/a: MoRI on SGLang {POLICY.version} sends no hybrid state (F3 n/a)")
    if backend == "mori" and component.startswith("state") and POLICY.is_live("F3"):
        pytest.skip(f"n/a: F3 is live on SGLang {POLICY.version}: stock MoRI's hybrid bootstrap crashes")
    scn = build()
    result = run_scenario(scn, backend, extra_env=_flip_env(component, buffer, page, scn.prefill_tp))
    assert_flip_unnoticed(result, scn, component, buffer, page)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_landed_flip_fails_the_room_with_verification(case):
    build, component, buffer, page, ranks = CASES[case]
    if NO_STATE and component.startswith("state"):
        pytest.skip(f"n/a: MoRI on SGLang {POLICY.version} sends no hybrid state (F3 n/a)")
    scn = build()
    result = run_scenario(scn, "mori-ext", extra_env={**VERIFY, **_flip_env(component, buffer, page, scn.prefill_tp)})
    assert_flip_failed_by_digest(result, component, buffer, ranks, prefill_told=True, scn=scn, page=page)


# The metadata rows over SGLang's TCP path (its default without RDMA aux) where the rows are
# ordered with the room's status: both sides mori-ext with F12 live (selftest_mori.needs_aux_rdma;
# F12 is live on every supported release).
AUX_TCP_WHY_NOT = ("" if not selftest_mori.needs_aux_rdma("mori-ext", "mori-ext")
                   else f"SGLang {POLICY.version}: MoRI's TCP metadata rows race the status here (F12 not live)")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("verified", [False, True], ids=["unverified", "verified"])
def test_metadata_rows_over_tcp_are_verified(verified):
    """One landed aux byte wrong (decode row 3 of buffer 0, flipped where decode takes the
    Success) with the rows sent as AUX_DATA messages: unverified mori-ext Success with the wrong
    byte (the harness's byte check), verified mori-ext Failed naming aux buffer 0; then three
    clean rooms over the same path, every one verified."""
    if AUX_TCP_WHY_NOT:
        pytest.skip(f"n/a: {AUX_TCP_WHY_NOT}")
    build, component, buffer, page, ranks = CASES["aux"]
    env = {**selftest_mori.standin_env(aux_rdma=False), **landed_flip_env(component, buffer, page),
           **(VERIFY if verified else {})}
    result = run_scenario(build(), "mori-ext", extra_env=env)
    if not verified:
        assert_flip_unnoticed(result, build(), component, buffer, page)
        return
    assert_flip_failed_by_digest(result, component, buffer, ranks, prefill_told=True, scn=build(), page=page)
    clean = run_scenario(three_rooms(build()), "mori-ext", extra_env={**selftest_mori.standin_env(aux_rdma=False),
                                                                     **VERIFY})
    assert clean.ok and all(r.decode_status == "Success" and r.bytes_verified for r in clean.requests), \
        clean.describe()
    assert counted_ok(clean) == [3.0], clean.plugin_metrics


KINDS = ("swa", "nsa", "dsv4", "mamba")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shape", ["tp1 page1", "tp1 page4", "tp2->1", "tp1->2"])
def test_no_false_alarm_over_random_transfers(shape):
    """Random page maps and lengths (empty included), chunking, aux rows; every state kind at
    equal TP, KV alone across TP sizes; every request Success, byte-checked by the harness and
    counted as verified on every decode rank."""
    n = int(os.environ.get("SGLANG_DISAGG_EXT_RANDOM_TRANSFERS", "150"))
    equal = shape.startswith("tp1 ")
    p, d = (1, 1) if equal else tuple(int(x) for x in shape[2:].split("->"))
    n = n if equal else max(8, n // 4)
    page_size = 4 if shape == "tp1 page4" else 1
    scenario = random_scenario(random.Random(61 + 7 * p + d + page_size), n, page_size,
                               KINDS if equal and not NO_STATE else (),
                               f"mori verify: {n} random transfers, page size {page_size}, tp{p}->tp{d}",
                               kv_heads=(HEADS, HEAD_DIM), state_heads=(HEADS, HEAD_DIM), prefill_tp=p, decode_tp=d)
    result = run_scenario(scenario, "mori-ext", extra_env=_env(**VERIFY), timeout_s=max(240, n * 0.8))
    assert result.ok, result.describe()
    assert len(result.requests) == n
    assert all(r.decode_status == "Success" and r.bytes_verified for r in result.requests), result.describe()
    assert counted_ok(result) == [float(n)] * d, result.plugin_metrics


@pytest.mark.timeout(180)
def test_a_verifying_prefill_leaves_a_stock_decode_as_stock():
    """A verifying ``mori-ext`` prefill with a stock ``mori`` decode: the digest is one more
    trailing frame of the status message (the common codec's on 0.5.20+, MoRI's own up to
    0.5.19), which stock's decode never reads. Three requests, every one Success
    with every byte right; nothing counted as verified on decode. Where F3 is live
    (0.5.12.x) mori-ext speaks its own per-component wire and refuses a stock decode at
    registration (test_mori_ext): n/a there."""
    if POLICY.fixes.get("F3") is releases.FixStatus.LIVE:
        pytest.skip(f"n/a: on SGLang {POLICY.version} mori-ext (F3) refuses a stock decode at registration")
    build, _, _, _, _ = CASES["kv"]
    assert_stock_decode_served(run_scenario(three_rooms(build()), "mori-ext", decode_backend="mori",
                                            extra_env=_env(**VERIFY)))
