"""The soak's pure parts: request generation, the per-request verdict, the wave expectations,
the dropped-write fault's address test. No SGLang, no engine.

Expected values are worked out by hand from the inputs written here.
"""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_disagg_ext.selftest import soak
from sglang_disagg_ext.selftest.harness import faults, patterns
from sglang_disagg_ext.selftest.harness.run import RequestResult, ScenarioResult
from sglang_disagg_ext.selftest.harness.scenario import (
    AUX_POOL_ID,
    KV_POOL_ID,
    STATE_POOL_BASE,
    KVPoolSpec,
    RequestSpec,
    Scenario,
    ScenarioError,
    StatePoolSpec,
    StateSpec,
)

pytestmark = pytest.mark.timeout(60)


def test_duplicate_rooms_name_an_earlier_valid_request_of_their_wave_and_leave_the_rest_as_seeded():
    base = soak.SoakConfig(requests=8, wave=4, fault_rate=0.0, bad_rate=0.0, seed=1, restart_decode=False)
    plain = soak.make_scenario(base)
    scn = soak.make_scenario(soak.SoakConfig(**{**base.__dict__, "duplicate_rate": 1.0}))
    scn.validate()
    # Rate 1: in wave 0 requests 1, 2, 3 each take a room of an earlier valid request; once 1 and 2
    # are duplicates, request 0 is the only valid one before them: all three name room 1000. Wave 1
    # is the clean last wave: untouched.
    assert [(r.room, r.fault) for r in scn.requests] == [(None, None)] + [(1000, "duplicate_room")] * 3 + [
        (None, None)] * 4
    assert scn.shared_rooms and not plain.shared_rooms
    # Everything else is what the seed made without duplicates.
    strip = [(r.src_kv_pages, r.dst_kv_pages, r.aux_index, r.state) for r in scn.requests]
    assert strip == [(r.src_kv_pages, r.dst_kv_pages, r.aux_index, r.state) for r in plain.requests]
    # A refused duplicate's pages must hold the sentinel; a failed holder's are not checked.
    statuses = {0: "Failed", 1: "Failed", 2: "Success", 3: "Failed"}
    per_room, untargeted = patterns.wave_expectations(scn, statuses)
    kv = untargeted[KV_POOL_ID].sentinel_pages
    assert not set(scn.requests[0].dst_kv_pages) & set(kv)  # the holder (first of room 1000): not checked
    assert set(scn.requests[1].dst_kv_pages) <= set(kv) and set(scn.requests[3].dst_kv_pages) <= set(kv)
    assert list(per_room) == [2]


def test_orphan_rooms_are_valid_requests_prefill_never_admits_and_decode_must_be_told():
    base = soak.SoakConfig(requests=8, wave=4, fault_rate=0.0, bad_rate=0.0, seed=1, restart_decode=False)
    scn = soak.make_scenario(soak.SoakConfig(**{**base.__dict__, "orphan_rate": 1.0}))
    scn.validate()
    # Rate 1: every request of wave 0 (wave 1 is the clean last wave); decode's waiting timeout doubled.
    assert [(r.prefill_admits, r.fault) for r in scn.requests] == [(False, "never_admitted")] * 4 + [(True, None)] * 4
    assert scn.timeouts.sglang_waiting_s == 2 * base.sglang_timeout_s == 2 * scn.timeouts.sglang_bootstrap_s
    # NIXL the same (F24); several ranks a side refused.
    nixl = soak.make_scenario(soak.SoakConfig(**{**base.__dict__, "orphan_rate": 1.0}), engine="nixl")
    assert [(r.prefill_admits, r.fault) for r in nixl.requests] == [(r.prefill_admits, r.fault) for r in scn.requests]
    with pytest.raises(ValueError, match="orphan rooms run one rank a side only"):
        soak.make_scenario(soak.SoakConfig(**{**base.__dict__, "orphan_rate": 1.0, "prefill_tp": 2}), engine="nixl")
    req = scn.requests[0]
    told = RequestResult(index=0, room=1000, prefill_status="NotAdmitted", decode_status="Failed",
                         decode_failure_reason="prefill never admitted bootstrap_room 1000: ...")
    own_clock = RequestResult(index=0, room=1000, prefill_status="NotAdmitted", decode_status="Failed",
                              decode_failure_reason="Request 1000 timed out after 16.0s in KVPoll.WaitingForInput")
    waiting = RequestResult(index=0, room=1000, prefill_status="NotAdmitted", decode_status="WaitingForInput")
    assert [soak.outcome(req, r) for r in (told, own_clock, waiting)] == [
        "failed_as_faulted", "decode_not_told", "hung"]


def test_mismatched_peer_requests_go_to_a_second_decode_and_must_write_nothing_there():
    base = soak.SoakConfig(requests=8, wave=4, fault_rate=0.0, bad_rate=0.0, seed=1, restart_decode=False)
    scn = soak.make_scenario(soak.SoakConfig(**{**base.__dict__, "mismatched_rate": 1.0}))
    scn.validate()
    # Rate 1: every request of wave 0 (wave 1 is the clean last wave); the second decode's KV pages
    # hold twice prefill's head dim (16 -> 32).
    assert [r.fault for r in scn.requests] == ["mismatched_peer"] * 4 + [None] * 4
    assert scn.kv.head_dim == 16 and scn.mismatched_decode_kv_head_dim == 32
    second = scn.mismatched_peer_scenario()
    assert second.decode_kv_head_dim == 32 and second.requests == scn.requests
    with pytest.raises(ValueError, match="mismatched peer runs on Mooncake"):
        soak.make_scenario(soak.SoakConfig(**{**base.__dict__, "mismatched_rate": 1.0}), engine="nixl")
    # A refused request of the mismatched decode must leave its pages untouched; a served one is checked.
    statuses = {0: "Failed", 1: "Success", 2: "Failed", 3: "Failed"}
    per_room, untargeted = patterns.wave_expectations(scn, statuses)
    kv = untargeted[KV_POOL_ID].sentinel_pages
    assert set(scn.requests[0].dst_kv_pages) <= set(kv) and set(scn.requests[2].dst_kv_pages) <= set(kv)
    assert not set(scn.requests[1].dst_kv_pages) & set(kv) and list(per_room) == [1]
    # Served with Success on both sides is the bug's signature (stock writes at prefill's page size).
    req = scn.requests[0]
    served = RequestResult(index=0, room=1000, prefill_status="Success", decode_status="Success", bytes_verified=True)
    refused = RequestResult(index=0, room=1000, prefill_status="Failed", decode_status="Failed",
                            prefill_failure_reason="decode ... KV layout differs", decode_failure_reason="... differs")
    assert [soak.outcome(req, r) for r in (served, refused)] == ["fault_unreported", "failed_as_faulted"]
    scn.mismatched_decode_kv_head_dim = 16  # prefill's own: not a mismatched peer
    with pytest.raises(ScenarioError, match="unlike prefill's 16"):
        scn.validate()


def test_generated_soak_keeps_its_promises():
    cfg = soak.SoakConfig(requests=200, wave=16, fault_rate=0.2, bad_rate=0.1, max_pages=5, seed=3)
    scn = soak.make_scenario(cfg)
    scn.validate()
    # 16 slots x 5 pages = decode pages 0..79, dropped pages 80..95; prefill 4 x 80 = 320 pages.
    assert scn.kv.num_pages == 320
    assert scn.dropped_kv_pages == list(range(80, 96))
    assert scn.state_pools[0].num_pages == 32 and scn.aux_rows == 16 and scn.wave == 16
    assert [len(w) for w in scn.waves()] == [16] * 12 + [8]
    for w, indices in enumerate(scn.waves()):
        seen = set()
        for i in indices:
            req = scn.requests[i]
            slot = i % 16
            assert 1 <= len(req.src_kv_pages) <= 5 and len(req.dst_kv_pages) == len(req.src_kv_pages)
            assert req.decode_aux_index == slot
            own = set(range(slot * 5, slot * 5 + 5))
            for d in req.dst_kv_pages:
                if req.fault == "engine" and d == 80 + slot:
                    continue
                if req.fault == "bad_index" and d >= 320:
                    continue
                assert d in own, (i, req)
            if req.fault == "engine":
                assert 80 + slot in req.dst_kv_pages
            if req.fault == "bad_index":
                assert req.allow_out_of_pool and any(320 <= d < 384 for d in req.dst_kv_pages)
            st = req.state[0]
            assert len(st.src_pages) == len(st.dst_pages) == min(len(req.src_kv_pages), 2)
            assert set(st.dst_pages) <= {2 * slot, 2 * slot + 1}
            assert not (set(req.dst_kv_pages) & seen)  # one wave never shares a decode page
            seen |= set(req.dst_kv_pages)
    last = scn.waves()[-1]
    assert all(scn.requests[i].fault is None for i in last)  # the clean last wave
    faults_seen = [r.fault for r in scn.requests]
    assert faults_seen.count("engine") > 0 and faults_seen.count("bad_index") > 0
    # The same config gives the same requests (stock and ext see one soak).
    assert soak.make_scenario(cfg).to_json() == scn.to_json()


def test_soak_config_is_checked():
    with pytest.raises(ValueError):
        soak.make_scenario(soak.SoakConfig(requests=10, wave=1))
    with pytest.raises(ValueError):
        soak.make_scenario(soak.SoakConfig(fault_rate=0.6, bad_rate=0.5))
    with pytest.raises(ValueError, match="sglang_timeout_s must be in"):
        soak.make_scenario(soak.SoakConfig(request_s=12.0, sglang_timeout_s=12.0))
    scn = soak.make_scenario(soak.SoakConfig(requests=8, wave=8))
    assert (scn.timeouts.sglang_waiting_s, scn.timeouts.sglang_bootstrap_s, scn.timeouts.request_s) == (8.0, 8.0, 30.0)
    scn.requests[0].fault = "cosmic ray"
    with pytest.raises(ScenarioError, match="fault 'cosmic ray'"):
        scn.validate()


def test_multi_rank_soak_config():
    # P=2 -> D=1: KV and SWA pools of 2 heads (one a rank at TP 2), no restart, no dropped pages.
    cfg = soak.SoakConfig(requests=96, wave=16, fault_rate=0.0, bad_rate=0.1, seed=5, prefill_tp=2, decode_tp=1)
    assert cfg.multi_rank and cfg.restart_wave() is None  # 6 waves, but one decode process per rank
    scn = soak.make_scenario(cfg)
    scn.validate()
    assert (scn.prefill_tp, scn.decode_tp) == (2, 1) and scn.restart_decode_in_wave is None
    assert scn.kv.head_num == 2 and scn.state_pools[0].head_num == 2 and scn.dropped_kv_pages == []
    # The same requests as one rank a side with the same seed: only the layout differs.
    one = soak.make_scenario(soak.SoakConfig(requests=96, wave=16, fault_rate=0.0, bad_rate=0.1, seed=5,
                                             restart_decode=False))
    assert [r.dst_kv_pages for r in one.requests] == [r.dst_kv_pages for r in scn.requests]
    assert one.kv.head_num == 2 and one.state_pools[0].head_num == 1
    # KV and aux only: no state pool, no request state.
    bare = soak.make_scenario(soak.SoakConfig(requests=8, wave=4, fault_rate=0.0, prefill_tp=1, decode_tp=2,
                                              state=False))
    assert bare.state_pools == [] and all(r.state == [] for r in bare.requests)
    # Dropped writes size a decode page from prefill's: one rank a side only; NIXL's
    # failed posts are counted per prefill rank and run with several.
    with pytest.raises(ValueError, match="dropped writes need one rank a side"):
        soak.make_scenario(soak.SoakConfig(requests=8, wave=4, fault_rate=0.1, prefill_tp=2))
    posts = soak.make_scenario(soak.SoakConfig(requests=8, wave=4, fault_rate=0.1, prefill_tp=2), engine="nixl")
    posts.validate()
    assert posts.fail_every_nth_post == 10 and posts.dropped_kv_pages == []


def test_multi_rank_waves_refuse_restart_and_dropped_pages():
    base = dict(requests=[RequestSpec([1], [k]) for k in range(6)], kv=KVPoolSpec(num_pages=8), aux_rows=2,
                wave=2, prefill_tp=2)
    Scenario("ok", **base).validate()  # waves with several ranks a side
    with pytest.raises(ScenarioError, match="need one rank a side"):
        Scenario("r", restart_decode_in_wave=1, **base).validate()
    with pytest.raises(ScenarioError, match="need one rank a side"):
        Scenario("d", dropped_kv_pages=[7], **base).validate()
    Scenario("p", fail_every_nth_post=4, **base).validate()  # failed posts: each prefill rank counts its own


def test_prefill_ranks_fault_reports_are_summed():
    from sglang_disagg_ext.selftest.harness.run import _merge_fault_reports

    a = {"fail_every": 8, "engine_calls_failed": 3, "engine_calls_passed": 21}
    b = {"fail_every": 8, "engine_calls_failed": 2, "engine_calls_passed": 17}
    assert _merge_fault_reports([a, None, b]) == {"fail_every": 8, "engine_calls_failed": 5,
                                                  "engine_calls_passed": 38}
    assert _merge_fault_reports([None, None]) is None


def _rr(**kw):
    base = dict(index=0, room=1000, prefill_status="Success", decode_status="Success", bytes_verified=True)
    base.update(kw)
    return RequestResult(**base)


@pytest.mark.parametrize(
    "fault, kw, want",
    [
        (None, {}, "ok"),
        (None, dict(bytes_verified=False, mismatches=["kv buffer 0 page 3: ..."]), "wrong_bytes"),
        (None, dict(prefill_status="Failed", decode_status="Failed", prefill_failure_reason="x"),
         "collateral_failure"),
        ("engine", dict(prefill_status="Failed", decode_status="Failed", prefill_failure_reason="Failed to send",
                        decode_failure_reason="Failed to send"), "failed_as_faulted"),
        ("engine", dict(prefill_status="Failed", decode_status="Failed"), "no_reason"),
        # Decode told: prefill's reason reached it (mooncake-ext 0.5.23, a bad index).
        ("bad_index", dict(prefill_status="Failed", decode_status="Failed", prefill_failure_reason="kv: index 795",
                           decode_failure_reason="decode session 127.0.0.1:15649: kv: destination index 795 "
                                                 "(position 3 of 5) outside decode's pool of 768 pages"),
         "failed_as_faulted"),
        # Decode never told: it ended the room on its own waiting timeout (SGLang's reason), or
        # with no reason at all; prefill's reason alone does not make it "failed as faulted".
        ("engine", dict(prefill_status="Failed", decode_status="Failed", prefill_failure_reason="Failed to send",
                        decode_failure_reason="Request 1000 timed out after 8.0s in KVPoll.WaitingForInput"),
         "decode_not_told"),
        ("bad_index", dict(prefill_status="Failed", decode_status="Failed", prefill_failure_reason="kv: index 795"),
         "decode_not_told"),
        ("bad_index", {}, "fault_unreported"),
        ("engine", dict(prefill_status="Failed", decode_status="Success"), "split"),
        (None, dict(decode_status="Transferring"), "hung"),
        (None, dict(prefill_status=None), "hung"),
        # send raised into the caller (a scheduler loop in a server): a violation even
        # for a faulted request, whatever the two sides' statuses became.
        ("bad_index", dict(prefill_status="WaitingForInput", decode_status="Failed",
                           error="prefill: raised into the caller: nixlNotFoundError: NIXL_ERR_NOT_FOUND"), "raised"),
        (None, dict(error="prefill: Traceback ... TimeoutError"), "ok"),  # other errors: judged by status and bytes
    ],
)
def test_outcome(fault, kw, want):
    req = RequestSpec([1], [2], fault=fault)
    assert soak.outcome(req, _rr(**kw)) == want


def test_judge_counts_and_verdict():
    scn = Scenario("j", [RequestSpec([1], [k]) for k in range(4)], kv=KVPoolSpec(num_pages=8), aux_rows=2, wave=2)
    scn.requests[1].fault = "engine"
    good = ScenarioResult("j", "mooncake-ext", requests=[
        _rr(index=0), _rr(index=1, prefill_status="Failed", decode_status="Failed", prefill_failure_reason="r",
                          decode_failure_reason="r", prefill_seconds=0.5, decode_seconds=0.25),
        _rr(index=2, prefill_seconds=0.1), _rr(index=3, decode_seconds=0.3)])
    s = soak.judge(scn, good)
    assert s["passed"] and s["outcomes"]["ok"] == 3 and s["outcomes"]["failed_as_faulted"] == 1
    assert s["faults_injected"] == {"engine": 1, "bad_index": 0, "duplicate_room": 0, "never_admitted": 0,
                                    "mismatched_peer": 0}
    # Request times: 0.5 (max of its sides), 0.1, 0.3 -> p50 0.3, max 0.5.
    assert s["p50_s"] == 0.3 and s["max_s"] == 0.5
    # The clean last wave (requests 2, 3) with one collateral failure: no pass.
    bad = ScenarioResult("j", "mooncake", requests=list(good.requests[:3]) + [
        _rr(index=3, prefill_status="Failed", decode_status="Failed")])
    s = soak.judge(scn, bad)
    assert not s["passed"] and not s["clean_wave_ok"] and s["violations"] == 1
    assert "collateral_failure" in s["violation_examples"]
    # A stray write or a dead thread fails the run even with every request right.
    stray = ScenarioResult("j", "x", requests=good.requests, waves={"decode": [{"stray_writes": ["kv page 7"]}]})
    assert not soak.judge(scn, stray)["passed"]
    died = ScenarioResult("j", "x", requests=good.requests, threads_died={"prefill": ["Thread-3 (ident 1)"]})
    assert not soak.judge(scn, died)["passed"]
    # A run that ended early (fewer records than requests) never passes.
    short = ScenarioResult("j", "x", requests=good.requests[:2])
    assert not soak.judge(scn, short)["passed"]


def test_judge_a_faulted_request_whose_decode_only_timed_out_is_a_violation():
    # Two waves of 2; request 1 (wave 0) carries a bad index, the last wave is clean.
    scn = Scenario("t", [RequestSpec([1], [k]) for k in range(4)], kv=KVPoolSpec(num_pages=8), aux_rows=2, wave=2)
    scn.requests[1].fault = "bad_index"
    timed_out = _rr(index=1, room=1001, prefill_status="Failed", decode_status="Failed", prefill_failure_reason="kv: index 9",
                    decode_failure_reason="Request 1001 timed out after 8.0s in KVPoll.WaitingForInput")
    s = soak.judge(scn, ScenarioResult("t", "mooncake-ext", requests=[_rr(index=0), timed_out, _rr(index=2),
                                                                      _rr(index=3)]))
    assert not s["passed"] and s["violations"] == 1
    assert s["outcomes"]["decode_not_told"] == 1 and s["outcomes"]["failed_as_faulted"] == 0
    assert s["violation_examples"]["decode_not_told"] == (
        "room 1001: prefill Failed, decode Failed: decode's reason "
        "'Request 1001 timed out after 8.0s in KVPoll.WaitingForInput'; prefill's 'kv: index 9'")
    # The same request with decode told (prefill's reason on decode): no violation.
    told = _rr(index=1, prefill_status="Failed", decode_status="Failed", prefill_failure_reason="kv: index 9",
               decode_failure_reason="kv: index 9")
    s = soak.judge(scn, ScenarioResult("t", "mooncake-ext", requests=[_rr(index=0), told, _rr(index=2),
                                                                      _rr(index=3)]))
    assert s["passed"] and s["outcomes"]["failed_as_faulted"] == 1 and s["outcomes"]["decode_not_told"] == 0


def _failed(index, reason="NIXL transfer encountered ERR"):
    return _rr(index=index, prefill_status="Failed", decode_status="Failed", prefill_failure_reason=reason)


def test_judge_bounds_failed_posts_by_their_count():
    # Three waves of 2; posts fail (1 in 4) in waves 0 and 1, never in the last.
    scn = Scenario("p", [RequestSpec([1], [k]) for k in range(6)], kv=KVPoolSpec(num_pages=8), aux_rows=2, wave=2,
                   fail_every_nth_post=4)
    two_failed = {"fail_every": 4, "engine_calls_failed": 2}
    reqs = [_failed(0), _rr(index=1), _rr(index=2), _failed(3), _rr(index=4), _rr(index=5)]
    s = soak.judge(scn, ScenarioResult("p", "nixl-ext", requests=reqs, dropped_writes=two_failed))
    assert s["passed"] and s["outcomes"]["failed_on_failed_post"] == 2 and s["outcomes"]["ok"] == 4
    assert s["fail_every_nth_post"] == 4 and s["engine_calls_failed"] == 2
    # One failed post, two failed requests: the second is a collateral failure.
    one_failed = {"fail_every": 4, "engine_calls_failed": 1}
    s = soak.judge(scn, ScenarioResult("p", "nixl-ext", requests=reqs, dropped_writes=one_failed))
    assert not s["passed"] and s["outcomes"]["failed_on_failed_post"] == 1
    assert s["outcomes"]["collateral_failure"] == 1
    # A failure in the clean last wave is never put on a failed post.
    late = reqs[:4] + [_failed(4), _rr(index=5)]
    s = soak.judge(scn, ScenarioResult("p", "nixl-ext", requests=late, dropped_writes={"engine_calls_failed": 9}))
    assert not s["passed"] and s["outcomes"]["collateral_failure"] == 1
    # Without a reason it stays a violation.
    quiet = [_failed(0, reason=None)] + reqs[1:]
    s = soak.judge(scn, ScenarioResult("p", "nixl-ext", requests=quiet, dropped_writes=two_failed))
    assert not s["passed"] and s["outcomes"]["collateral_failure"] == 1


def test_nixl_soak_marks_no_request_and_fails_posts():
    cfg = soak.SoakConfig(requests=64, wave=16, fault_rate=1 / 16, bad_rate=1 / 32, seed=7)
    moon, nixl = soak.make_scenario(cfg), soak.make_scenario(cfg, engine="nixl")
    assert nixl.fail_every_nth_post == 16 and nixl.dropped_kv_pages == [] and moon.fail_every_nth_post == 0
    assert not any(r.fault == "engine" for r in nixl.requests)
    # The same bad-index requests as Mooncake's, with the same bad pages.
    assert any(r.fault == "bad_index" for r in nixl.requests)
    assert [(i, r.dst_kv_pages) for i, r in enumerate(moon.requests) if r.fault == "bad_index"] == [
        (i, r.dst_kv_pages) for i, r in enumerate(nixl.requests) if r.fault == "bad_index"]
    with pytest.raises(ScenarioError, match="fail_every_nth_post must be 0"):
        Scenario("x", [RequestSpec([1], [1])], fail_every_nth_post=1).validate()
    with pytest.raises(ScenarioError, match="exclude each other"):
        Scenario("x", [RequestSpec([1], [1])], kv=KVPoolSpec(num_pages=4), fail_every_nth_post=4,
                 dropped_kv_pages=[3]).validate()


def test_failed_posts_fail_every_nth_and_only_those():
    agent = SimpleNamespace(posted=[])
    agent.transfer = lambda handle, *a: agent.posted.append(handle) or "PROC"
    agent.check_xfer_state = lambda handle: "DONE"
    state = faults.fail_nixl_posts(SimpleNamespace(agent=agent), 3)
    handles = [object() for _ in range(7)]
    assert [agent.transfer(h) for h in handles] == ["PROC"] * 7
    # Posts 3 and 6 failed: never reached the agent, ERR from then on; the rest are the agent's.
    assert agent.posted == [handles[i] for i in (0, 1, 3, 4, 6)]
    assert [agent.check_xfer_state(h) for h in handles] == ["DONE", "DONE", "ERR", "DONE", "DONE", "ERR", "DONE"]
    assert state.report() == {"fail_every": 3, "engine_calls_failed": 2, "engine_calls_passed": 5}
    state.active = False  # a fault-free wave
    more = [object() for _ in range(3)]
    for h in more:
        agent.transfer(h)
    assert agent.posted[-3:] == more and state.calls_failed == 2
    with pytest.raises(ValueError):
        faults.fail_nixl_posts(SimpleNamespace(agent=agent), 1)


def test_wave_expectations_by_hand():
    # Two requests in a wave; request 0 ended Success, request 1 Failed.
    scn = Scenario(
        "w",
        [RequestSpec([1, 2], [4, 5], aux_index=0, dst_aux_index=0, state=[StateSpec("swa", [0], [2])]),
         RequestSpec([3], [6], aux_index=1, dst_aux_index=1, state=[StateSpec("swa", [1], [3])])],
        kv=KVPoolSpec(num_pages=8), state_pools=[StatePoolSpec("swa", num_pages=4)], aux_rows=2, wave=2,
    )
    per_room, untargeted = patterns.wave_expectations(scn, {0: "Success", 1: "Failed"})
    assert set(per_room) == {0}
    assert per_room[0][KV_POOL_ID].writes == {4: 1, 5: 2}
    assert per_room[0][AUX_POOL_ID].writes == {0: 0}
    assert per_room[0][STATE_POOL_BASE].writes == {2: 0}
    assert all(e.sentinel_pages == [] for e in per_room[0].values())
    # Untargeted: neither request's pages (the failed one's are not checked at all).
    assert untargeted[KV_POOL_ID].sentinel_pages == [0, 1, 2, 3, 7]
    assert untargeted[AUX_POOL_ID].sentinel_pages == []
    assert untargeted[STATE_POOL_BASE].sentinel_pages == [0, 1]


def test_dropped_writes_hit_only_the_chosen_pages():
    # Two decode KV buffers at 0x10000 and 0x20000, 256-byte pages; pages 3 and 5 dropped.
    # A second, older registration "old" (a decode that died) at 0x30000: its pages are
    # never dropped for a write to session "s", nor "s"'s for a write to "old".
    info = SimpleNamespace(dst_kv_ptrs=[0x10000, 0x20000])
    old = SimpleNamespace(dst_kv_ptrs=[0x30000])
    mgr = SimpleNamespace(kv_args=SimpleNamespace(kv_item_lens=[256]), decode_kv_args_table={"s": info, "old": old})
    d = faults.DroppedWrites(mgr, [5, 3])
    assert d.hits("s", [0x10000 + 3 * 256], [256])  # page 3 of buffer 0
    assert d.hits("s", [0x20000 + 5 * 256 + 10], [8])  # inside page 5 of buffer 1
    assert d.hits("s", [0x10000 + 2 * 256], [512])  # pages 2-3 in one descriptor
    assert not d.hits("s", [0x10000 + 2 * 256], [256])  # page 2 ends where page 3 starts
    assert not d.hits("s", [0x10000 + 4 * 256, 0x20000 + 6 * 256], [256, 256])
    assert not d.hits("s", [0x30000 + 3 * 256], [256])  # "old"'s page 3, written via "s"
    assert d.hits("old", [0x30000 + 3 * 256], [256])
    assert not d.hits("old", [0x10000 + 3 * 256], [256])
    assert not d.hits("unknown", [0x10000 + 3 * 256], [256])  # not registered (yet)


def test_dropped_writes_wrap_the_engine_instance():
    calls = []

    class Engine:
        def batch_transfer_sync(self, session_id, buffers, peer_buffer_addresses, lengths):
            calls.append(list(peer_buffer_addresses))
            return 0

    info = SimpleNamespace(dst_kv_ptrs=[0x1000])
    mgr = SimpleNamespace(engine=Engine(), kv_args=SimpleNamespace(kv_item_lens=[64]),
                          decode_kv_args_table={"s": info})
    state = faults.drop_engine_writes(mgr, [2])
    assert mgr.engine.batch_transfer_sync("s", [1], [0x1000 + 2 * 64], [64]) == faults.ENGINE_FAILURE
    assert mgr.engine.batch_transfer_sync("s", [1], [0x1000], [64]) == 0
    assert calls == [[0x1000]]  # the dropped call never reached the engine
    assert state.report() == {"pages": [2], "engine_calls_failed": 1, "engine_calls_passed": 1}
    assert np.array_equal(state.pages, [2])


def test_restart_wave_is_the_middle_one_and_carries_no_faults():
    cfg = soak.SoakConfig(requests=200, wave=16, fault_rate=0.3, bad_rate=0.2, seed=5)
    # 200 / 16 -> 13 waves (12 full + 8): the decode dies in wave 13 // 2 = 6.
    assert cfg.restart_wave() == 6
    scn = soak.make_scenario(cfg)
    assert scn.restart_decode_in_wave == 6
    assert all(scn.requests[i].fault is None for i in scn.waves()[6])
    assert any(scn.requests[i].fault for i in scn.waves()[5])  # rate 0.5 over 16: not all clean
    # Fewer than 3 waves, or switched off: no restart.
    assert soak.SoakConfig(requests=32, wave=16).restart_wave() is None
    assert soak.SoakConfig(requests=200, wave=16, restart_decode=False).restart_wave() is None


@pytest.mark.parametrize("k", [-1, 2, 3, True, 1.0])
def test_restart_wave_must_be_followed_by_one(k):
    # 6 requests, 2 at a time: waves 0, 1, 2; a restart in 0 or 1 leaves a wave after it.
    scn = Scenario("r", [RequestSpec([1], [j]) for j in range(6)], kv=KVPoolSpec(num_pages=8), aux_rows=2, wave=2,
                   restart_decode_in_wave=k)
    with pytest.raises(ScenarioError, match="restart_decode_in_wave"):
        scn.validate()
    scn.restart_decode_in_wave = 1
    scn.validate()


def test_role_rank_of_the_restarted_decode():
    from sglang_disagg_ext.selftest.harness import run

    assert run._role_rank(run.RESTARTED_DECODE) == ("decode", 0)
    assert run._role_rank("prefill1") == ("prefill", 1) and run._role_rank("decode") == ("decode", 0)


@pytest.mark.parametrize(
    "kw, want",
    [
        (dict(prefill_status="Failed", decode_status=None, prefill_failure_reason="session not alive"),
         "lost_with_decode"),
        (dict(prefill_status="Success", decode_status=None), "lost_with_decode"),  # written before the kill
        (dict(prefill_status="Transferring", decode_status=None), "hung"),
        (dict(prefill_status=None, decode_status=None), "hung"),
    ],
)
def test_outcome_on_the_killed_decode(kw, want):
    assert soak.outcome(RequestSpec([1], [2]), _rr(**kw), on_killed_decode=True) == want


def test_judge_with_a_restarted_decode():
    from sglang_disagg_ext.selftest.harness.run import RESTARTED_DECODE

    # 6 requests, waves [0,1] [2,3] [4,5]; decode killed in wave 1.
    scn = Scenario("k", [RequestSpec([1], [j]) for j in range(6)], kv=KVPoolSpec(num_pages=8), aux_rows=2, wave=2,
                   restart_decode_in_wave=1)
    reqs = [_rr(index=0), _rr(index=1),
            _rr(index=2, prefill_status="Failed", decode_status=None, prefill_failure_reason="not alive"),
            _rr(index=3, prefill_status="Success", decode_status=None),
            _rr(index=4), _rr(index=5)]
    waves = {"decode": [{"wave": 0}], RESTARTED_DECODE: [{"wave": 2}]}
    s = soak.judge(scn, ScenarioResult("k", "mooncake-ext", requests=reqs, waves=waves))
    assert s["passed"] and s["decode_killed_in_wave"] == 1 and s["decode_restarted"]
    assert s["outcomes"]["ok"] == 4 and s["outcomes"]["lost_with_decode"] == 2
    # No successor ran: no pass, whatever the records say.
    s = soak.judge(scn, ScenarioResult("k", "mooncake-ext", requests=reqs, waves={"decode": [{"wave": 0}]}))
    assert not s["passed"] and not s["decode_restarted"]
    # A stray write seen by the successor counts like one seen by the first decode.
    waves = {"decode": [{"wave": 0}], RESTARTED_DECODE: [{"wave": 2, "stray_writes": ["kv page 7"]}]}
    assert not soak.judge(scn, ScenarioResult("k", "x", requests=reqs, waves=waves))["passed"]
    # A request of a later wave failing on the new decode is a collateral failure.
    late = reqs[:4] + [_rr(index=4, prefill_status="Failed", decode_status="Failed", prefill_failure_reason="x"),
                       reqs[5]]
    s = soak.judge(scn, ScenarioResult("k", "x", requests=late, waves={"decode": [], RESTARTED_DECODE: [{}]}))
    assert not s["passed"] and s["outcomes"]["collateral_failure"] == 1


def test_soak_main_refuses_what_it_cannot_run(capsys):
    from types import SimpleNamespace as NS

    from sglang_disagg_ext.selftest import runner

    opts = NS(protocol="tcp", device_type="cpu")
    base = dict(requests=8, wave=4, fault_rate=0.0, bad_rate=0.0, seed=0, json=False)
    policy = NS(version="x")
    assert runner.soak_main(NS(backend=["mori"], **base), policy, opts) == 2
    assert runner.soak_main(NS(backend=["mooncake", "nixl"], **base), policy, opts) == 2
    assert runner.soak_main(NS(backend=None, **base), policy, NS(protocol="rdma", device_type="cpu")) == 2
    assert runner.soak_main(NS(backend=None, **dict(base, wave=1)), policy, opts) == 2
    assert runner.soak_main(NS(backend=None, prefill_tp=2, decode_tp=1, **base), policy, opts) == 2
    err = capsys.readouterr().err
    assert "one backend" in err and "TCP with CPU pools" in err and "wave >= 2" in err
    assert "several ranks a side runs NIXL only" in err


def test_failed_posts_of_one_kind_and_late_err():
    # kind="aux": only handles made with an aux tag count; every=1 fails each of them.
    agent = SimpleNamespace(posted=[])
    agent.initialize_xfer = lambda op, src, dst, peer, notif=b"", *a: SimpleNamespace(tag=notif)
    agent.transfer = lambda handle, *a: agent.posted.append(handle) or "PROC"
    agent.check_xfer_state = lambda handle: "DONE"
    state = faults.fail_nixl_posts(SimpleNamespace(agent=agent), 1, kind="aux", err_after_s=0.2)
    kv = agent.initialize_xfer("WRITE", [], [], "d", b"5_kv_0_1_0")
    aux = agent.initialize_xfer("WRITE", [], [], "d", b"5_aux")
    nokv = agent.initialize_xfer("WRITE", [], [], "d", b"6_aux_nokv_0")
    for h in (kv, aux, nokv):
        agent.transfer(h)
    assert agent.posted == [kv]
    assert [agent.check_xfer_state(h) for h in (kv, aux, nokv)] == ["DONE", "PROC", "PROC"]  # loss seen late
    time.sleep(0.25)
    assert [agent.check_xfer_state(h) for h in (kv, aux, nokv)] == ["DONE", "ERR", "ERR"]
    assert state.report() == {"fail_every": 1, "engine_calls_failed": 2, "engine_calls_passed": 0,
                              "fail_kind": "aux"}


def test_aux_post_fault_validation():
    base = dict(requests=[RequestSpec([1], [1])], prefill_tp=2)
    Scenario("a", fail_aux_posts_of_prefill_rank=1, **base).validate()
    for bad in (2, -1, True):
        with pytest.raises(ScenarioError, match="fail_aux_posts_of_prefill_rank"):
            Scenario("a", fail_aux_posts_of_prefill_rank=bad, **base).validate()
    with pytest.raises(ScenarioError, match="fail_aux_posts_of_prefill_rank"):
        Scenario("a", fail_aux_posts_of_prefill_rank=0, fail_every_nth_post=4, **base).validate()
    with pytest.raises(ScenarioError, match="failed_post_err_after_s"):
        Scenario("a", failed_post_err_after_s=-0.1, **base).validate()
    assert Scenario("a", fail_aux_posts_of_prefill_rank=0, **base).fails_posts
    assert not Scenario("a", **base).fails_posts
