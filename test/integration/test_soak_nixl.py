"""The soak through ``nixl-ext``, one rank a side: real NIXL over UCX (TCP) on loopback, CPU pools.

64 requests, 32 in flight, random page maps and sizes with an SWA state component and an
aux row each; one in 16 carries a decode KV index outside the pool (handed to SGLang's
real ``send_metadata``); no restart. Every request is judged by the harness
(``selftest.soak.judge``): each bad request Failed on both sides with a reason, every
other one Success with every byte right, no page written that no request targeted,
nothing raised into the caller, no thread gone.

Where ``nixl-ext`` is F4's classes (0.5.10.post1-0.5.12.x) the bad index is refused by
the plugin before any descriptor is built (decode publishes its pool sizes in a trailing
registration frame, ``backends/nixl/conn.py``), and the reason names the index and the pool
size. Stock there has no such check and NIXL only checks that a remote descriptor lies
in *some* region the peer registered, so what stock does depends on the address layout:
measured on this rig, 0.5.10.post1 wrote the bad pages into the next registered buffer
(both sides Success, valid requests' pages overwritten), 0.5.11's ``send`` raised
``NIXL_ERR_NOT_FOUND`` into its caller, 0.5.12.post1 failed them with NIXL's error name.
The soak makes no stock assertion: a stock run that happens to fail cleanly proves
nothing either way. What does not depend on the layout is the descriptor stock builds,
and test_out_of_pool_index_stock_aims_outside_decode_pool_ext_never asserts that: prefill's
agent records every remote descriptor it is asked to write (``test/support/xfer_audit.py``),
and against decode's KV pool ranges derived by hand (the pointers decode registered x the
scenario's 192 pages x 256 bytes) stock aims each bad page past the end of every K and V
buffer, one of them past every KV buffer decode registered, while ``nixl-ext`` builds no
descriptor outside decode's pools at all. On 0.5.23 NIXL itself refuses the index
(``NIXL_ERR_INVALID_PARAM``).

Replaced: on releases where ``nixl-ext`` is stock for memory registration (F4 not live)
the rig's host-memory shim lets NIXL register the CPU pools (``harness/nixl_shim.py``;
this machine's UCX has no CUDA). The engine fault for NIXL is a failed post (``harness/faults.py``).

The decode restart, differential, where ``nixl-ext`` is F4's classes: the decode worker
SIGKILLs itself in wave 1 of 3 after sending half that wave's metadata. Stock NIXL's
sender has no bootstrap deadline on these releases (``NixlKVSender.poll`` returns the
manager's status as is), so the rooms whose metadata never came stay Bootstrapping past
the harness's bound ("hung"; on 0.5.12.post1 rooms whose metadata did come also stay
WaitingForInput, their transfer to the dead decode never concluding); ``-ext`` ends every
room of the killed wave within the bound and serves the new decode.
"""

import dataclasses
import json
import os

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest import soak
from sglang_disagg_ext.selftest.harness.run import run_scenario

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()


def _f4_classes_routed() -> bool:
    from sglang_disagg_ext.backends.nixl import conn as nixl

    return "NixlKVReceiver" in nixl.ext_classes(POLICY)


@pytest.mark.timeout(180)
def test_nixl_ext_soak_fails_exactly_the_bad_requests():
    # No request here needs SGLang's timeouts to end (bad ones are refused), so they get 20 s:
    # in one CI run on 0.5.23, under the full suite's load, no room of the first wave left
    # Bootstrapping within the default 8 s (every later wave did), and all 32 failed.
    cfg = soak.SoakConfig(requests=64, wave=32, fault_rate=0.0, bad_rate=1 / 16, seed=11, restart_decode=False,
                          sglang_timeout_s=20.0)
    scn = soak.make_scenario(cfg, name="soak-nixl-ext")
    res = run_scenario(scn, "nixl-ext", extra_env=soak.soak_env("nixl-ext"))
    s = soak.judge(scn, res)
    assert s["passed"], soak.format_summaries([s])
    bad = [i for i, r in enumerate(scn.requests) if r.fault == "bad_index"]
    assert bad and s["outcomes"]["failed_as_faulted"] == len(bad) == s["faults_injected"]["bad_index"]
    assert s["outcomes"]["ok"] == cfg.requests - len(bad) and not s["stray_writes"]
    assert s["outcomes"]["raised"] == 0 and s["outcomes"]["hung"] == 0
    if not _f4_classes_routed():
        return  # 0.5.23: NIXL's own refusal; its reason is NIXL's error name
    # Pool size by hand: 32 slots x 6 pages = 192 decode pages, pool 4 x 192 = 768 (soak.make_scenario).
    for i in bad:
        rr = res.requests[i]
        want = [d for d in scn.requests[i].dst_kv_pages if d >= 768][0]
        for reason in (rr.prefill_failure_reason, rr.decode_failure_reason):
            assert f"kv: destination index {want} " in reason and "outside decode's pool of 768 pages" in reason, reason


AUDIT_HOOK = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "xfer_audit.py")


def _audited_run(backend: str, scn, out: str):
    """``scn`` through ``backend`` with prefill's NIXL agent recording every remote descriptor
    it is asked to write (``test/support/xfer_audit.py``); the run and the recorded lines."""
    env = dict(soak.soak_env(backend) or {})
    env.update({"SGLANG_HARNESS_PREFILL_HOOK": f"{AUDIT_HOOK}:record_remote_descs", "SGLANG_HARNESS_XFER_AUDIT": out})
    res = run_scenario(scn, backend, extra_env=env)
    with open(out) as f:
        return res, [json.loads(line) for line in f]


def _decode_regions(peer: dict, kv_pages: int, aux_rows: int, state_pages: int) -> dict:
    """Decode's registered pools as address ranges, by hand: each buffer pointer decode sent
    in its registration, times the pool's page (row) count from the scenario, times the item
    length (KV: decode's own, from its registration; aux and state: prefill's, the same pools)."""
    def ranges(ptrs, item_lens, n):
        assert len(ptrs) == len(item_lens), (ptrs, item_lens)
        return [(p, p + n * il) for p, il in zip(ptrs, item_lens)]

    kv = peer["dst_kv_ptrs"]
    return {
        "kv": ranges(kv, [peer["dst_kv_item_len"]] * len(kv), kv_pages),
        "aux": ranges(peer["dst_aux_ptrs"], peer["aux_item_lens"], aux_rows),
        "state": ranges(peer["dst_state_ptrs"], peer["state_item_lens"], state_pages),
    }


def _outside(desc, ranges) -> bool:
    addr, n = desc
    return not any(lo <= addr and addr + n <= hi for lo, hi in ranges)


@pytest.mark.skipif(not _f4_classes_routed(), reason=f"n/a on SGLang {POLICY.version}: nixl-ext is not F4's "
                    "classes here, and only F4's classes bound a NIXL decode index (the differential is F4's)")
@pytest.mark.timeout(150)
def test_out_of_pool_index_stock_aims_outside_decode_pool_ext_never(tmp_path):
    """The remote descriptors behind an out-of-pool decode KV index, stock ``nixl`` vs
    ``nixl-ext``: 16 requests, 8 in flight, two of the first wave (rooms 1002, 1004) with
    a decode KV index past decode's pool of 192 pages. Prefill's agent records every
    remote (decode-side) descriptor it is asked to write (``test/support/xfer_audit.py``),
    before NIXL checks it.

    What NIXL then does with stock's descriptor depends on the address layout (NIXL only
    checks that it lies in *some* region the peer registered): the page lands in the next
    registered buffer with Success on both sides, or NIXL refuses it and the error reaches
    the caller or fails the room (the module docstring). The descriptor itself does not:
    stock builds, for each bad room, a write of the bad page in every K and V buffer of
    decode, each past its buffer's end, and the one in the highest buffer past every KV
    buffer decode registered. ``-ext`` builds none: every descriptor of the run lies inside
    the decode pool its tag names, the bad rooms end Failed on both sides naming the index
    and pool size, every other room Success with every byte right."""
    cfg = soak.SoakConfig(requests=16, wave=8, fault_rate=0.0, bad_rate=1 / 4, seed=0, restart_decode=False)
    scn = soak.make_scenario(cfg, name="audit-nixl", engine="nixl")
    # By hand: 8 slots x 6 pages = 48, both sides' pool 4 x 48 = 192 pages (soak.make_scenario);
    # a KV page is page_size 4 x 2 heads x 16 dims x 2 bytes (bf16) = 256 bytes; aux: one row
    # a slot (8); SWA state: 2 pages a slot (16).
    kv_pages, item_len, aux_rows, state_pages = 192, 256, 8, 16
    assert (scn.kv.num_pages, scn.aux_rows, scn.state_pools[0].num_pages) == (kv_pages, aux_rows, state_pages)
    bad = {1000 + i: [d for d in r.dst_kv_pages if d >= kv_pages][0]
           for i, r in enumerate(scn.requests) if r.fault == "bad_index"}
    assert bad == {1002: 233, 1004: 225}, bad

    # Stock's outcome is not judged, only its descriptors: shorter bounds (a room NIXL
    # refuses stays WaitingForInput on prefill until the wave bound) keep the run short.
    stock_scn = dataclasses.replace(scn, timeouts=dataclasses.replace(scn.timeouts, request_s=10.0))
    runs = {b: _audited_run(b, s, str(tmp_path / f"{b}.jsonl")) for b, s in (("nixl", stock_scn), ("nixl-ext", scn))}

    def audit(backend):
        """Per room: its KV descriptors outside decode's KV pool, and (every kind) outside
        the decode pool its tag names; the KV page ranges of decode's buffers."""
        res, lines = runs[backend]
        peers = [line for line in lines if line["op"] == "peer"]
        assert len(peers) == 1 and peers[0]["dst_kv_item_len"] == item_len, peers
        regions = _decode_regions(peers[0], kv_pages, aux_rows, state_pages)
        posts = [line for line in lines if line["op"] != "peer"]
        # On these releases every write goes through initialize_xfer; a prepared list
        # would be a path this audit does not attribute to a room.
        assert posts and all(line["op"] == "initialize_xfer" for line in posts), {line["op"] for line in posts}
        kv_out, any_out, kv_descs = {}, {}, {}
        for line in posts:
            room, kind = line["tag"].split("_")[:2]
            assert kind in regions, line["tag"]
            room = int(room)
            if kind == "kv":
                kv_descs.setdefault(room, []).extend(line["remote"])
                kv_out.setdefault(room, []).extend(d for d in line["remote"] if _outside(d, regions["kv"]))
            any_out.setdefault(room, []).extend(d for d in line["remote"] if _outside(d, regions[kind]))
        return res, regions, kv_descs, {r: d for r, d in kv_out.items() if d}, {r: d for r, d in any_out.items() if d}

    res, regions, kv_descs, kv_out, any_out = audit("nixl")
    for room, want in bad.items():
        # The bad page, aimed in each of decode's K and V buffers: past that buffer's end
        # (want >= 192), so whatever it hits is not the room's page; the highest buffer's
        # lies past every KV buffer, whatever the layout.
        aims = [lo + want * item_len for lo, _ in regions["kv"]]
        for a in aims:
            assert any(d[0] <= a and a + item_len <= d[0] + d[1] for d in kv_descs.get(room, [])), (
                room, want, a, kv_descs.get(room))
        assert kv_out.get(room), (room, want, regions["kv"], kv_descs.get(room))
    assert set(kv_out) == set(bad), kv_out  # valid rooms' descriptors lie inside the pool

    res, regions, kv_descs, kv_out, any_out = audit("nixl-ext")
    assert not any_out and not kv_out, any_out  # no descriptor outside decode's pools, any room
    assert not set(bad) & set(kv_descs), {r: kv_descs[r] for r in set(bad) & set(kv_descs)}
    assert len(kv_descs) == cfg.requests - len(bad), sorted(kv_descs)
    s = soak.judge(scn, res)
    assert s["passed"], soak.format_summaries([s])
    assert s["outcomes"]["failed_as_faulted"] == len(bad) and s["outcomes"]["ok"] == cfg.requests - len(bad)
    for rr in res.requests:
        if rr.room not in bad:
            assert rr.ok and rr.bytes_verified and not rr.mismatches, res.describe()
            continue
        assert (rr.prefill_status, rr.decode_status) == ("Failed", "Failed"), res.describe()
        for reason in (rr.prefill_failure_reason, rr.decode_failure_reason):
            assert f"kv: destination index {bad[rr.room]} " in reason, reason
            assert "outside decode's pool of 192 pages" in reason, reason


@pytest.mark.skipif(not _f4_classes_routed(), reason=f"n/a on SGLang {POLICY.version}: nixl-ext is not F4's "
                    "classes here, and stock's sender has the bootstrap deadline (CommonKVSender)")
@pytest.mark.timeout(240)
def test_dead_decode_rooms_stock_stay_bootstrapping_ext_fail_in_bound():
    # Wave bound 12 s > SGLang's bootstrap timeout in the harness (Timeouts.sglang_bootstrap_s,
    # 8 s): a deadline shows up as Failed, no deadline as "hung".
    cfg = soak.SoakConfig(requests=96, wave=32, fault_rate=0.0, bad_rate=0.0, seed=11, request_s=12.0)
    assert cfg.restart_wave() == 1
    ext = soak.run_soak("nixl-ext", cfg)
    assert ext["passed"] and ext["decode_restarted"], soak.format_summaries([ext])
    assert ext["outcomes"]["lost_with_decode"] == 32 and ext["outcomes"]["ok"] == 64

    stock = soak.run_soak("nixl", cfg)
    assert stock["decode_restarted"], soak.format_summaries([stock, ext])
    assert stock["outcomes"]["hung"] > 0 and not stock["passed"], soak.format_summaries([stock, ext])
    # The hung rooms are the killed wave's (no decode record): Bootstrapping where the
    # metadata never came; on 0.5.12.x also WaitingForInput where it did and the
    # transfer to the dead decode never concludes.
    assert "decode None" in stock["violation_examples"]["hung"], stock["violation_examples"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)], ids=["tp2-tp1", "tp1-tp2"])
def test_nixl_ext_soak_over_ranks(p, d):
    """The soak with P prefill and D decode rank processes (heterogeneous TP, 2 KV heads: one
    a rank at TP 2): 64 requests, 32 in flight, one in 16 with an out-of-pool decode KV index,
    each prefill rank failing 1 in 16 of the transfers it posts in the first wave. Each failed
    request ends Failed on both sides: with two prefill ranks that needs decode to wait for
    every rank's aux row (``core.nixl_quorum``; before it, 0.5.12.post1 split 12 of 512: one
    rank's row completed the room on decode while the other rank's post of it failed,
    test_decode_waits_for_every_prefill_ranks_aux_row).
    Every decode rank checks every element of the heads it holds and that no page outside
    the wave's targets was written. Each request carries an SWA window cache too
    (``soak.carries_state``: ``nixl-ext`` slices it by heads on every release; stock up to
    0.5.12.x refuses it per request, test_nixl_ext.py::test_swa_state_across_tp_sizes_every_element).
    No stock assertion: the heterogeneous-TP differentials are test_nixl_ext.py's."""
    cfg = soak.SoakConfig(requests=64, wave=32, fault_rate=1 / 16, bad_rate=1 / 16, seed=11,
                          prefill_tp=p, decode_tp=d, state=soak.carries_state("nixl", p, d))
    scn = soak.make_scenario(cfg, name=f"soak-nixl-ext-tp{p}-tp{d}", engine="nixl")
    res = run_scenario(scn, "nixl-ext", extra_env=soak.soak_env("nixl-ext"))
    s = soak.judge(scn, res)
    assert s["passed"], soak.format_summaries([s])
    assert (s["prefill_tp"], s["decode_tp"]) == (p, d) and s["engine_calls_failed"] > 0
    bad = [i for i, r in enumerate(scn.requests) if r.fault == "bad_index"]
    assert bad and s["outcomes"]["failed_as_faulted"] == len(bad)
    assert s["outcomes"]["ok"] + s["outcomes"]["failed_on_failed_post"] == cfg.requests - len(bad)
    assert not s["stray_writes"]
    # Every rank of each side took part in every request.
    for rr in res.requests:
        assert sorted(rr.rank_status) == [f"decode{r}" for r in range(d)] + [f"prefill{r}" for r in range(p)], rr


@pytest.mark.timeout(240)
def test_failed_nixl_posts_end_their_requests_on_both_sides():
    """Prefill's agent fails 1 in 8 of the transfers it posts in the first wave
    (``harness.faults.fail_nixl_posts``: nothing moves, ``check_xfer_state`` says ERR
    from then on; the second wave is clean). 64 requests, 32 in flight, no bad index.

    ``-ext`` on every release: no more requests fail than posts were failed, each Failed
    on both sides with a reason, every other request Success with every byte right.
    Where ``nixl-ext`` is F4's classes, decode is told (the reason names the prefill
    rank that failed it) instead of waiting out SGLang's waiting timeout: stock drops
    the room's peers after posting its last chunk, so nobody could tell decode.
    Stock, where its sender's poll raises on an ERR handle
    (``releases.features().stock_nixl_sender_poll_raises``: 0.5.10.post1, 0.5.11):
    requests "raised" into the caller, the soak fails; elsewhere stock passes too."""
    cfg = soak.SoakConfig(requests=64, wave=32, fault_rate=1 / 8, bad_rate=0.0, seed=3, restart_decode=False)
    ext = soak.run_soak("nixl-ext", cfg)
    assert ext["passed"], soak.format_summaries([ext])
    assert ext["fail_every_nth_post"] == 8 and ext["engine_calls_failed"] > 0, soak.format_summaries([ext])
    failed = ext["outcomes"]["failed_on_failed_post"]
    assert 0 < failed <= ext["engine_calls_failed"] and ext["outcomes"]["ok"] == 64 - failed
    stock = soak.run_soak("nixl", cfg)
    if releases.features().stock_nixl_sender_poll_raises:
        assert stock["outcomes"]["raised"] > 0 and not stock["passed"], soak.format_summaries([stock, ext])
    else:
        assert stock["passed"], soak.format_summaries([stock, ext])


@pytest.mark.skipif(not _f4_classes_routed(), reason=f"n/a on SGLang {POLICY.version}: nixl-ext is not F4's "
                    "classes here (stock's transfer worker tells decode)")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["nixl", "nixl-ext"])
def test_decode_is_told_of_a_failed_nixl_post(backend):
    """One wave of 32 then a clean one. With ``nixl-ext`` the failed posts' requests end
    Failed on decode with the prefill rank's reason; stock never tells decode (it drops the
    room's peers after the last chunk, or its transfer worker fails the room on prefill
    only), so decode ends them through SGLang's waiting timeout (``Timeouts.sglang_waiting_s``),
    measured on 0.5.10.post1, 0.5.11 and 0.5.12.post1."""
    cfg = soak.SoakConfig(requests=64, wave=32, fault_rate=1 / 8, bad_rate=0.0, seed=3, restart_decode=False)
    scn = soak.make_scenario(cfg, name=f"soak-{backend}-posts", engine="nixl")
    res = run_scenario(scn, backend, extra_env=soak.soak_env(backend))
    failed = [rr for rr in res.requests if rr.decode_status == "Failed"]
    assert failed, res.describe()
    for rr in failed:
        if backend == "nixl":
            assert "timed out after" in rr.decode_failure_reason, rr.decode_failure_reason
            continue
        assert rr.prefill_status == "Failed", res.describe()
        assert "prefill rank 0 (" in rr.decode_failure_reason and "failed the transfer" in rr.decode_failure_reason, (
            rr.decode_failure_reason)
        assert "timed out" not in rr.decode_failure_reason, rr.decode_failure_reason
    # Every other request Success with every byte right, no page outside the wave's targets written.
    s = soak.judge(scn, res)
    assert s["outcomes"]["ok"] == cfg.requests - len(failed) and not s["stray_writes"], soak.format_summaries([s])


@pytest.mark.skipif(not _f4_classes_routed(), reason=f"n/a on SGLang {POLICY.version}: nixl-ext is not F4's "
                    "classes here (0.5.23 decode completes on status messages, not on the aux notification)")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["nixl", "nixl-ext"])
def test_decode_waits_for_every_prefill_ranks_aux_row(backend):
    """Prefill TP 2 -> decode TP 1, two waves of 16. In the first, prefill rank 1's agent
    fails every aux row it posts (``harness.faults.fail_nixl_posts(mgr, 1, kind="aux")``:
    nothing moves; the handle reads PROC for 0.5 s, then ERR, as a loss seen late); rank
    0's aux rows and both ranks' KV land. The second wave is clean.

    Every prefill rank writes the same aux row, and stock decode marks a room's aux
    received on the first ``<room>_aux`` notification (0.5.10.post1 nixl/conn.py:839-840,
    0.5.11 :1022-1023, 0.5.12.post1 :1670), so rank 0's row completes the room on decode
    while rank 1 fails it on prefill: a split, found by the soak on 0.5.12.post1 (12 of
    512). ``nixl-ext``'s decode releases a room's aux notifications once every prefill
    rank it expects (SGLang's ``required_prefill_response_num``) has sent one, so the
    room waits for rank 1, which tells decode it failed: Failed on both sides, the reason
    naming prefill rank 1. Stock, where its TP 2 -> 1 completes at all (KV tags keyed on
    the TP rank, ``stock_nixl_kv_tag_sender_field == "engine_rank"``: 0.5.12.x): every
    faulted room splits. Up to 0.5.11 stock decode never completes TP 2 -> 1 (F4's key),
    so there is no stock run to compare."""
    if backend == "nixl" and releases.features().stock_nixl_kv_tag_sender_field != "engine_rank":
        pytest.skip(f"n/a on SGLang {POLICY.version}: stock NIXL decode never completes TP 2 -> 1 here "
                    "(F4's notification key, test_nixl_ext.py), so the aux split cannot show")
    cfg = soak.SoakConfig(requests=32, wave=16, fault_rate=0.0, bad_rate=0.0, seed=5, prefill_tp=2, decode_tp=1,
                          state=False)
    scn = soak.make_scenario(cfg, name=f"aux-rank1-{backend}", engine="nixl")
    # SGLang's bounds well above the soak's 8 s: the first wave also sets up both NIXL
    # peers, and on a loaded CI machine stock's wave 0 once timed out on decode before any
    # aux row was read, where the split shows. Neither side's outcome here is a timeout.
    bounds = dataclasses.replace(scn.timeouts, request_s=90.0, sglang_waiting_s=30.0, sglang_bootstrap_s=30.0)
    scn = dataclasses.replace(scn, timeouts=bounds, fail_aux_posts_of_prefill_rank=1, failed_post_err_after_s=0.5)
    res = run_scenario(scn, backend, extra_env=soak.soak_env(backend))
    assert res.dropped_writes and res.dropped_writes.get("fail_kind") == "aux", res.dropped_writes
    assert res.dropped_writes["engine_calls_failed"] == 16, res.dropped_writes  # wave 0's rows on rank 1
    first, second = res.requests[:16], res.requests[16:]
    for rr in second:  # clean wave: every byte right on both ranks' heads
        assert rr.ok and rr.bytes_verified and not rr.mismatches, res.describe()
    if backend == "nixl":
        split = [rr for rr in first if rr.prefill_status == "Failed" and rr.decode_status == "Success"]
        assert split, res.describe()
        return
    for rr in first:
        assert (rr.prefill_status, rr.decode_status) == ("Failed", "Failed"), res.describe()
        assert "prefill rank 1 (" in (rr.decode_failure_reason or ""), rr.decode_failure_reason
        assert "timed out" not in rr.decode_failure_reason, rr.decode_failure_reason
    s = soak.judge(scn, res)
    assert s["outcomes"]["ok"] == 16 and not s["stray_writes"], soak.format_summaries([s])
