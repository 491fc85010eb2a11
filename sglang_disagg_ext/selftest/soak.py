"""The soak: many concurrent requests with faults, every request's end checked by the harness.

    sglang-disagg-ext selftest --soak [--requests N --wave C --fault-rate R --bad-rate B --seed S --no-restart]

One prefill and one decode worker (real managers, real Mooncake over TCP on
loopback, CPU pools) run ``requests`` requests ``wave`` at a time
(``Scenario.wave``): random KV page maps and sizes, an SWA state component,
one aux row each. A share ``fault_rate`` of requests target a decode KV page
whose writes prefill's engine fails (``harness.faults``: a link that drops
writes), a share ``bad_rate`` carry a decode KV index outside decode's pool, and a
share ``duplicate_rate`` of the valid ones name the bootstrap room of an earlier valid
request of their wave (F16: refused on both sides, writing nothing); a share
``orphan_rate`` (one rank a side) are never admitted by prefill: decode sends its metadata for
a room no request on prefill opens, and must be told Failed (F17's lease; F24's on NIXL); and a share
``mismatched_rate`` (Mooncake) come from a second decode process, started beside the first,
whose KV head dim is twice prefill's (a misconfigured peer in the pool, F18): refused on both
sides, writing nothing there, while the first decode is served as before.
The last wave is clean: after the faults, the same workers must serve it.

What every request ended as is judged here from the workers' records, never by
the code under test (:func:`judge`): a valid request must end Success on both
sides with every destination byte right; a faulted one Failed on both sides
with a reason, decode's not merely its own timeout (decode was told); every
request final within the bound; no write on a page no request of its wave
targeted; no thread of either worker gone. The same soak runs through the
stock backend and the ``-ext`` one, and :func:`format_summaries` prints both
side by side.

In the middle wave the decode worker kills itself (SIGKILL, after sending the
metadata of half that wave's requests) and the harness starts a new decode
process (new engine, new session) for the waves after it; prefill must end each
of the killed wave's requests within the bound, and serve the new decode.

NIXL (UCX over TCP) has its own engine fault: NIXL's transfer handles name no
request (0.5.23 posts prepared handles without a notification), so prefill's
agent fails every ``round(1 / fault_rate)``-th transfer it posts
(``harness.faults.fail_nixl_posts``), no request is marked, and :func:`judge`
allows at most that many valid requests to end Failed (on both sides, with a
reason: "failed on failed post"), only in the waves where posts were failed.
It runs one rank a side with the restart, or several ranks a side (``prefill_tp``/``decode_tp``, e.g. P=2/D=1 and
P=1/D=2: one process per rank, each rank's pools holding its share of
``KV_HEADS_MULTI_RANK`` heads, every decode rank checking every element of its
heads), with failed posts (each prefill rank counts its own) and without the
restart, which replaces the one decode process of a 1x1 run.
Up to 0.5.12.x SGLang does not send SWA state across different TP sizes (stock
and ``nixl-ext``), so the CLI runs those with KV and aux only.

Not covered yet: mismatched state lengths as a bad input (0.5.23
truncates SWA/DSA state lists on purpose, mooncake/conn.py), Mooncake with
several ranks a side.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Dict, List, Optional

from sglang_disagg_ext.selftest.harness.run import RESTARTED_DECODE, ScenarioResult, run_scenario
from sglang_disagg_ext.selftest.harness.scenario import (
    MISMATCHED_PEER,
    NOT_ADMITTED,
    RAISED_INTO_CALLER,
    REQUEST_FAULTS,
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)

STATE_KIND = "swa"
SWA_WINDOW_PAGES = 2
PREFILL_POOL_FACTOR = 4  # prefill KV pool: this many times decode's request region
# Multi-rank soaks: KV (and SWA) heads of the model, so TP 2 holds one head a rank.
KV_HEADS_MULTI_RANK = 2
ROOM_BASE = 1000  # request i's bootstrap room is ROOM_BASE + i, unless it duplicates another's


@dataclasses.dataclass
class SoakConfig:
    requests: int = 512
    wave: int = 64
    fault_rate: float = 1 / 16  # requests whose decode page's writes the engine drops
    bad_rate: float = 1 / 32  # requests with a decode KV index outside the pool
    # Requests that name the bootstrap room of an earlier valid request of their wave (F16),
    # drawn from their own random stream so that the other requests stay what the seed made.
    duplicate_rate: float = 0.0
    # Requests prefill never admits (no sender; decode sends its metadata as usual: F17's
    # lease), from their own random stream too. Mooncake, one rank a side. With any, SGLang's
    # waiting timeout is twice ``sglang_timeout_s``, so that prefill's lease (its bootstrap
    # timeout) ends the room before decode's own clock would.
    orphan_rate: float = 0.0
    # Requests served by a second decode process whose KV head dim is twice the first's
    # (another model configuration joining the pool: F18's mismatched peer), from their own
    # random stream too; prefill serves both decodes at once. Mooncake, one rank a side.
    mismatched_rate: float = 0.0
    max_pages: int = 6  # KV pages per request: 1 .. max_pages
    seed: int = 0
    request_s: float = 30.0  # bound on each wave, each side
    # SGLang's own waiting and bootstrap timeouts in the workers (Timeouts.sglang_*): a room
    # nobody ends ends Failed on SGLang's clock after this, so it must stay under request_s.
    # A soak whose verdict needs no timeout to fire gives a loaded machine more room here.
    sglang_timeout_s: float = 8.0
    # Kill the decode worker in the middle wave (SIGKILL, half its metadata sent) and
    # start a new one for the waves after it (Scenario.restart_decode_in_wave); needs
    # at least 3 waves.
    restart_decode: bool = True
    # Attention TP sizes, one worker process per rank (P=2/D=1, P=1/D=2: heterogeneous
    # TP, each rank holding its share of KV_HEADS_MULTI_RANK heads). Several ranks a
    # side: no dropped writes and no restart (both model one process a side).
    prefill_tp: int = 1
    decode_tp: int = 1
    state: bool = True  # each request carries an SWA state component

    @property
    def multi_rank(self) -> bool:
        return self.prefill_tp > 1 or self.decode_tp > 1

    def restart_wave(self) -> Optional[int]:
        n_waves = -(-self.requests // self.wave)
        return n_waves // 2 if self.restart_decode and n_waves >= 3 and not self.multi_rank else None


def make_scenario(cfg: SoakConfig, name: str = "soak", engine: str = "mooncake") -> Scenario:
    """The soak's requests, derived from ``cfg`` alone (the same for stock and ext).

    ``engine`` "mooncake": a share ``fault_rate`` of requests target a dropped decode
    page (``harness.faults.drop_engine_writes``). "nixl": prefill's agent fails every
    ``round(1 / fault_rate)``-th transfer it posts instead (``fail_nixl_posts``: NIXL
    handles name no request), no request is marked, and :func:`judge` bounds the
    failures by that count; the bad-index requests are the same as Mooncake's.

    Decode KV pages: slot ``k`` of a wave owns pages ``[k*max_pages, (k+1)*max_pages)``,
    so the requests of one wave never share a page; after those, one dropped page
    per slot (``Scenario.dropped_kv_pages``). State: slot ``k`` owns SWA pages
    ``[k*2, k*2+2)``; aux: slot ``k`` owns decode row ``k``."""
    if cfg.requests < 1 or cfg.wave < 2:
        raise ValueError(f"soak needs requests >= 1 and wave >= 2, got {cfg.requests}, {cfg.wave}")
    if not 0 <= cfg.fault_rate + cfg.bad_rate < 1:
        raise ValueError(f"fault_rate + bad_rate must be in [0, 1), got {cfg.fault_rate} + {cfg.bad_rate}")
    if not 0 < cfg.sglang_timeout_s < cfg.request_s:
        raise ValueError(f"sglang_timeout_s must be in (0, request_s {cfg.request_s}), got {cfg.sglang_timeout_s}")
    if engine not in ("mooncake", "nixl"):
        raise ValueError(f"soak engine must be mooncake or nixl, got {engine!r}")
    if cfg.multi_rank and cfg.fault_rate > 0 and engine == "mooncake":
        raise ValueError(f"dropped writes need one rank a side (harness.faults), got prefill_tp {cfg.prefill_tp}, "
                         f"decode_tp {cfg.decode_tp} with fault_rate {cfg.fault_rate}")
    rng = random.Random(cfg.seed)
    region = cfg.wave * cfg.max_pages
    dropped = list(range(region, region + cfg.wave))
    drop_pages = engine == "mooncake" and cfg.fault_rate > 0
    prefill_kv_pages = PREFILL_POOL_FACTOR * region
    # Both sides build the same pool (the harness's KVPoolSpec); decode uses its first
    # region + wave pages. A bad index lies beyond the whole pool.
    kv_pool_pages = max(prefill_kv_pages, region + cfg.wave)
    state_pages = cfg.wave * SWA_WINDOW_PAGES
    n_waves = -(-cfg.requests // cfg.wave)
    # No faults in the last wave (it shows the workers still serve) nor in the one whose
    # decode is killed (its requests are lost with that decode whatever they carry).
    clean_waves = {n_waves - 1} if n_waves > 1 else set()
    clean_waves |= {cfg.restart_wave()} - {None}
    requests: List[RequestSpec] = []
    for index in range(cfg.requests):
        slot = index % cfg.wave
        clean = index // cfg.wave in clean_waves
        n = rng.randint(1, cfg.max_pages)
        src = rng.sample(range(prefill_kv_pages), n)
        own = list(range(slot * cfg.max_pages, (slot + 1) * cfg.max_pages))
        dst = rng.sample(own, n)
        window = min(n, SWA_WINDOW_PAGES)
        st_src = rng.sample(range(state_pages), window)
        st_dst = rng.sample(range(slot * SWA_WINDOW_PAGES, (slot + 1) * SWA_WINDOW_PAGES), window)
        u = rng.random()
        fault = None
        if not clean and u < cfg.fault_rate:
            j = rng.randrange(n)  # drawn for NIXL too: both engines get the same other requests
            if drop_pages:
                fault = "engine"
                dst[j] = dropped[slot]
        elif not clean and u < cfg.fault_rate + cfg.bad_rate:
            fault = "bad_index"
            dst[rng.randrange(n)] = kv_pool_pages + rng.randrange(0, 64)
        requests.append(RequestSpec(
            src_kv_pages=src, dst_kv_pages=dst, aux_index=rng.randrange(cfg.wave), dst_aux_index=slot,
            state=[StateSpec(STATE_KIND, st_src, st_dst)] if cfg.state else [],
            allow_out_of_pool=fault == "bad_index", fault=fault,
        ))
    orphans = _add_orphan_rooms(cfg, requests, clean_waves, engine)
    # Before the duplicates: a duplicate's holder is a valid request of the first decode.
    mismatched = _add_mismatched_peer(cfg, requests, clean_waves, engine)
    duplicates = _add_duplicate_rooms(cfg, requests, clean_waves)
    heads = {"head_num": KV_HEADS_MULTI_RANK} if cfg.multi_rank else {}
    return Scenario(
        name=name,
        requests=requests,
        kv=KVPoolSpec(num_pages=kv_pool_pages, **heads),
        state_pools=[StatePoolSpec(kind=STATE_KIND, num_pages=state_pages, **heads)] if cfg.state else [],
        prefill_tp=cfg.prefill_tp,
        decode_tp=cfg.decode_tp,
        aux_rows=cfg.wave,
        wave=cfg.wave,
        dropped_kv_pages=dropped if drop_pages else [],
        fail_every_nth_post=max(2, round(1 / cfg.fault_rate)) if engine == "nixl" and cfg.fault_rate > 0 else 0,
        restart_decode_in_wave=cfg.restart_wave(),
        room_base=ROOM_BASE,
        shared_rooms=duplicates > 0,
        mismatched_decode_kv_head_dim=2 * KVPoolSpec().head_dim if mismatched else 0,
        timeouts=Timeouts(request_s=cfg.request_s,
                          sglang_waiting_s=cfg.sglang_timeout_s * (2 if orphans else 1),
                          sglang_bootstrap_s=cfg.sglang_timeout_s),
    )


# The fix that releases a never-admitted room, per soak engine.
ORPHAN_FIX = {"mooncake": "F17", "nixl": "F24"}


def _add_orphan_rooms(cfg: SoakConfig, requests: List[RequestSpec], clean_waves, engine: str) -> int:
    """Make a share ``orphan_rate`` of the valid requests outside the clean waves ones prefill
    never admits (``RequestSpec.prefill_admits``): decode must be told Failed (the lease of
    ``ORPHAN_FIX[engine]``),
    not end the room on its own clock. Returns how many were made."""
    if cfg.orphan_rate <= 0:
        return 0
    if cfg.multi_rank:
        raise ValueError("orphan rooms run one rank a side only")
    if 2 * cfg.sglang_timeout_s >= cfg.request_s:
        raise ValueError(f"orphan rooms need request_s > 2 x sglang_timeout_s (decode's waiting timeout), "
                         f"got {cfg.request_s} and {cfg.sglang_timeout_s}")
    made = 0
    for _, req, _ in _share(cfg, requests, clean_waves, "orphan rooms", cfg.orphan_rate):
        req.prefill_admits, req.fault = False, "never_admitted"
        made += 1
    return made


def _add_mismatched_peer(cfg: SoakConfig, requests: List[RequestSpec], clean_waves, engine: str) -> int:
    """Make a share ``mismatched_rate`` of the valid requests outside the clean waves ones the
    second decode serves, whose KV pages are twice as large as prefill's (F18): each must end
    Failed on both sides with a reason and write nothing there, while prefill serves the first
    decode as before. Returns how many were made."""
    if cfg.mismatched_rate <= 0:
        return 0
    if cfg.multi_rank or engine != "mooncake":
        raise ValueError("a mismatched peer runs on Mooncake, one rank a side only")
    made = 0
    for _, req, _ in _share(cfg, requests, clean_waves, "mismatched peer", cfg.mismatched_rate):
        req.fault = MISMATCHED_PEER
        made += 1
    return made


def _add_duplicate_rooms(cfg: SoakConfig, requests: List[RequestSpec], clean_waves) -> int:
    """Make a share ``duplicate_rate`` of the valid requests outside the clean waves name the
    room of an earlier valid request of their wave (both live at once: F16's duplicate). The
    duplicate keeps its own pages; it must be refused on both sides and write nothing, its
    holder served as any valid request. Returns how many were made."""
    if cfg.duplicate_rate <= 0:
        return 0
    if cfg.multi_rank:
        raise ValueError("duplicate rooms run one rank a side only")
    made = 0
    for index, req, rng in _share(cfg, requests, clean_waves, "duplicate rooms", cfg.duplicate_rate):
        w = index // cfg.wave
        holders = [j for j in range(w * cfg.wave, index) if requests[j].fault is None]
        if holders:
            req.room, req.fault = ROOM_BASE + rng.choice(holders), "duplicate_room"
            made += 1
    return made


def _share(cfg: SoakConfig, requests: List[RequestSpec], clean_waves, stream: str, rate: float):
    """The valid requests outside the clean waves that a share ``rate`` of them, drawn from the
    fault's own seeded stream ``stream``, gets: yields (index, request, that stream's generator),
    lazily, so a request marked by the caller is no longer valid for the ones after it."""
    rng = random.Random(f"{cfg.seed}:{stream}")
    for index, req in enumerate(requests):
        if index // cfg.wave in clean_waves or rng.random() >= rate or req.fault is not None:
            continue
        yield index, req, rng


OUTCOMES = ("ok", "failed_as_faulted", "failed_on_failed_post", "lost_with_decode", "collateral_failure",
            "wrong_bytes", "split", "fault_unreported", "no_reason", "decode_not_told", "hung", "raised")
VIOLATIONS = OUTCOMES[4:]

# What SGLang's decode records when it ends a room on its own clock (its waiting or
# bootstrap timeout) instead of being told: "Request <room> timed out after <s>s in
# KVPoll.WaitingForInput" (every release's receiver, 0.5.11 mooncake/nixl conn.py, 0.5.23
# common/conn.py; MoRI "... waiting for KV transfer"). A told failure carries prefill's
# reason (e.g. "Failed to send kv chunk of <room> to ...", "... destination index ...
# outside decode's pool ...").
DECODE_TIMEOUT_REASON = "timed out after"


def decode_was_told(rr) -> bool:
    """Decode ended the room Failed with a reason that is not merely its own timeout."""
    reason = rr.decode_failure_reason or ""
    return bool(reason) and DECODE_TIMEOUT_REASON not in reason


def outcome(req: RequestSpec, rr, on_killed_decode: bool = False) -> str:
    """What one request ended as (``RequestResult`` ``rr``), judged from both sides' records.

    "raised": the worker's ``send`` / ``send_metadata`` for it raised into the caller
    (``scenario.RAISED_INTO_CALLER``); in a server that is the scheduler loop.
    ``on_killed_decode``: the request was in the wave whose decode process was killed;
    that decode left no record, so prefill alone must have reached a final state
    (Success, when its writes had all landed before the kill, or Failed)."""
    final = ("Success", "Failed")
    if rr.error and RAISED_INTO_CALLER in rr.error:
        return "raised"  # into SGLang's caller (a scheduler loop), whatever the statuses say
    if on_killed_decode:
        return "lost_with_decode" if rr.prefill_status in final else "hung"
    if req.fault == "never_admitted":
        # Prefill made no sender: decode alone ends the room, and must have been told.
        if rr.prefill_status != NOT_ADMITTED or rr.decode_status not in final:
            return "hung"
        if rr.decode_status == "Success":
            return "fault_unreported"
        return "failed_as_faulted" if decode_was_told(rr) else "decode_not_told"
    if rr.prefill_status not in final or rr.decode_status not in final:
        return "hung"
    if rr.prefill_status != rr.decode_status:
        return "split"
    if rr.decode_status == "Success":
        if req.fault is not None:
            return "fault_unreported"
        return "ok" if rr.bytes_verified and not rr.mismatches else "wrong_bytes"
    if req.fault is None:
        return "collateral_failure"
    if not rr.prefill_failure_reason:
        return "no_reason"
    # Failed on decode only through its own timeout (or with no reason): prefill never
    # told it, and a server's decode would hold the request that long.
    return "failed_as_faulted" if decode_was_told(rr) else "decode_not_told"


def _percentile(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def judge(scn: Scenario, res: ScenarioResult) -> Dict[str, Any]:
    """The soak's summary and its verdict (``passed``), from the run's records."""
    counts = {o: 0 for o in OUTCOMES}
    faults = {f: 0 for f in REQUEST_FAULTS}
    examples: Dict[str, str] = {}
    times = []
    clean_wave = set(scn.waves()[-1]) if len(scn.waves()) > 1 else set()
    k = scn.restart_decode_in_wave
    killed = set(scn.waves()[k]) if k is not None else set()
    clean_ok = True
    # NIXL's failed posts name no request: a valid request Failed on both sides with a
    # reason, in a wave where posts were failed, counts against the posts failed; any
    # beyond that many are collateral failures. (No record ties a failed post to its room:
    # faults.FailedPosts counts posts, and 0.5.23 posts prepared handles with no
    # notification tag, nixl/conn.py make_prepped_xfer.)
    n_waves = len(scn.waves())
    post_fault_waves = ({w for w in range(n_waves)} - {n_waves - 1, k}) if scn.fails_posts else set()
    posts_failed = (res.dropped_writes or {}).get("engine_calls_failed", 0) if scn.fails_posts else 0
    wave_of = {i: w for w, idx in enumerate(scn.waves()) for i in idx}
    for req, rr in zip(scn.requests, res.requests):
        o = outcome(req, rr, rr.index in killed)
        if (o == "collateral_failure" and wave_of.get(rr.index) in post_fault_waves and rr.prefill_failure_reason
                and counts["failed_on_failed_post"] < posts_failed):
            o = "failed_on_failed_post"
        counts[o] += 1
        if req.fault:
            faults[req.fault] += 1
        if o in VIOLATIONS and o not in examples:
            detail = rr.prefill_failure_reason or rr.decode_failure_reason or "; ".join(rr.mismatches[:2]) or ""
            if o == "decode_not_told":  # what decode ended it with is the point here
                detail = f"decode's reason {rr.decode_failure_reason!r}; prefill's {rr.prefill_failure_reason!r}"
            examples[o] = f"room {rr.room}: prefill {rr.prefill_status}, decode {rr.decode_status}: {detail}"[:400]
        if rr.index in clean_wave and o != "ok":
            clean_ok = False
        ends = [s for s in (rr.prefill_seconds, rr.decode_seconds) if s is not None]
        if ends:
            times.append(max(ends))
    stray = [line for waves in res.waves.values() for w in waves for line in w.get("stray_writes", [])]
    died = {name: names for name, names in res.threads_died.items() if names}
    violations = sum(counts[o] for o in VIOLATIONS)
    complete = not res.error and len(res.requests) == len(scn.requests)
    return {
        "backend": res.backend,
        "sglang": res.sglang_version,
        "manager": res.prefill_manager,
        "requests": len(scn.requests),
        "wave": scn.wave,
        "prefill_tp": scn.prefill_tp,
        "decode_tp": scn.decode_tp,
        "state": [pool.kind for pool in scn.state_pools],
        "outcomes": counts,
        "faults_injected": faults,
        "decode_killed_in_wave": k,
        "decode_restarted": k is not None and bool(res.waves.get(RESTARTED_DECODE)),
        "engine_calls_failed": (res.dropped_writes or {}).get("engine_calls_failed", 0),
        "fail_every_nth_post": scn.fail_every_nth_post,
        "violations": violations,
        "violation_examples": examples,
        "stray_writes": stray[:10],
        "threads_died": died,
        "clean_wave_ok": clean_ok,
        "p50_s": _percentile(times, 50),
        "p99_s": _percentile(times, 99),
        "max_s": max(times) if times else None,
        "wall_s": res.wall_seconds,
        "error": res.error,
        "passed": (complete and violations == 0 and not stray and not died and clean_ok
                   and (k is None or bool(res.waves.get(RESTARTED_DECODE)))),
    }


def carries_state(family: str, prefill_tp: int, decode_tp: int) -> bool:
    """Whether the soak's requests carry SWA state for ``family`` ("mooncake", "nixl") at these
    TP sizes on the installed release: always at equal sizes; across sizes where the ``-ext``
    backend sends SWA head slices: ``nixl-ext`` on every supported release (its own slices up
    to 0.5.12.x (F4) and on 0.5.13-0.5.21 (F13), stock's from 0.5.22), ``mooncake-ext`` where stock Mooncake does
    (``releases.features().stock_swa_head_slice_backends``: 0.5.23). Stock NIXL up to 0.5.12.x
    refuses SWA state across TP sizes per request; the side-by-side soak shows it."""
    if prefill_tp == decode_tp or family == "nixl":
        return True
    from sglang_disagg_ext import releases

    return family in releases.features().stock_swa_head_slice_backends


def soak_env(backend: str) -> Optional[Dict[str, str]]:
    """Worker environment for ``backend``: NIXL's stock side (and ``nixl-ext`` where its
    F4 classes, which register host memory themselves, are not installed) gets the
    rig's host-memory shim (``harness/nixl_shim.py``): on a CPU machine's UCX stock
    NIXL cannot register its "VRAM" pools at all, and the soak is not about memory kinds."""
    if not backend.startswith("nixl"):
        return None
    from sglang_disagg_ext import releases
    from sglang_disagg_ext.selftest.harness import nixl_shim

    if backend.endswith("-ext") and releases.current_policy().is_live("F4"):
        return None
    return {nixl_shim.ENV: "1"}


def run_soak(backend: str, cfg: SoakConfig, python: Optional[str] = None,
             timeout_s: Optional[float] = None) -> Dict[str, Any]:
    engine = "nixl" if backend.startswith("nixl") else "mooncake"
    scn = make_scenario(cfg, name=f"soak-{backend}", engine=engine)
    res = run_scenario(scn, backend, timeout_s, python=python, extra_env=soak_env(backend))
    return judge(scn, res)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def format_summaries(summaries: List[Dict[str, Any]]) -> str:
    """The soak's summaries side by side, one column per backend."""
    rows = [("backend", lambda s: s["backend"]), ("SGLang", lambda s: s["sglang"] or "?"),
            ("requests (wave)", lambda s: f"{s['requests']} ({s['wave']})"),
            ("prefill TP -> decode TP", lambda s: f"{s['prefill_tp']} -> {s['decode_tp']}"),
            ("state", lambda s: ", ".join(s["state"]) or "none (KV, aux)"),
            ("faults: engine / bad / dup room / orphan / mismatched peer", lambda s: (
                f"{s['engine_calls_failed']} posts (1 in {s['fail_every_nth_post']})" if s["fail_every_nth_post"]
                else str(s["faults_injected"]["engine"])) + f" / {s['faults_injected']['bad_index']}"
                + f" / {s['faults_injected']['duplicate_room']} / {s['faults_injected']['never_admitted']}"
                + f" / {s['faults_injected']['mismatched_peer']}"),
            ("decode killed, restarted", lambda s: "no" if s["decode_killed_in_wave"] is None else
             f"wave {s['decode_killed_in_wave']}, " + ("restarted" if s["decode_restarted"] else "NOT restarted"))]
    rows += [(o.replace("_", " "), (lambda o: lambda s: str(s["outcomes"][o]))(o)) for o in OUTCOMES]
    rows += [("stray writes", lambda s: str(len(s["stray_writes"]))),
             ("threads died", lambda s: str(sum(len(v) for v in s["threads_died"].values()))),
             ("clean last wave", lambda s: "all ok" if s["clean_wave_ok"] else "NOT all ok"),
             ("time to final p50 / p99", lambda s: f"{_fmt(s['p50_s'])} / {_fmt(s['p99_s'])}"),
             ("wall", lambda s: f"{s['wall_s']:.0f} s"),
             ("verdict", lambda s: "PASS" if s["passed"] else "FAIL")]
    width = max(len(r[0]) for r in rows)
    cols = [[fn(s) for _, fn in rows] for s in summaries]
    colw = [max(len(c) for c in col) for col in cols]
    lines = []
    for i, (label, _) in enumerate(rows):
        lines.append(f"{label:<{width}}  " + "  ".join(f"{col[i]:<{w}}" for col, w in zip(cols, colw)))
    for s in summaries:
        for o, ex in s["violation_examples"].items():
            lines.append(f"{s['backend']} {o.replace('_', ' ')}: {ex}")
        if s["error"]:
            lines.append(f"{s['backend']} error: {s['error'][:300]}")
    return "\n".join(lines)
