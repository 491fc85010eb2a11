"""Built-in NIXL scenarios for F4: used by ``test/integration/test_nixl_ext.py`` and ``selftest``.

Each scenario runs through the transfer harness (real NIXL over UCX on
127.0.0.1, CPU tensors, one process per rank) and says what counts as a pass
and what stock SGLang does on each release, so tests and the selftest table
read the same facts.

Stock runs of the heterogeneous-TP scenarios get the harness's host-memory
shim (``harness/nixl_shim.py``): without it stock fails at buffer registration
on a CPU-only UCX and never reaches the head slice or the notification keys
those scenarios are about. ``-ext`` runs never get it. The host-memory
scenario runs stock without the shim.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)

# Short SGLang timeouts: a stock decode that never completes ends Failed in
# seconds; request_s leaves room for two cores shared by every rank. 6 s was
# too short on a loaded 2-core runner (load ~11): a decode timed out before a
# CPU-starved prefill had posted its write, in ext and stock runs alike. With
# five processes (P1->D4) on two cores, the prefill took up to 11.0 s from the
# last decode rank's send_metadata to "bootstrapped" (its bootstrap thread
# handling four registrations and four room messages; 43 runs measured), so
# 12 s was at the edge as well.
# Workers fork from a warm server (harness.procs), so no rank imports SGLang
# while another transfers; 10 s of SGLang waiting is far above what an -ext
# run needs (0.01-0.1 s a request) and is what a stock run that never
# completes waits out.
TIMEOUTS = Timeouts(request_s=60.0, startup_s=150.0, sglang_waiting_s=10.0, sglang_bootstrap_s=10.0)
# Five processes (P1->D4) on two cores: in one CI run two decode ranks came out
# of their rank barrier 12-15 s after the others (frozen processes), and the
# prefill's writes then took 15.7 s: 30.7 s from the first rank's send to
# prefill Success, past 20 s (before pacing and the fork server; 30 s keeps margin).
FIVE_RANK_TIMEOUTS = Timeouts(request_s=100.0, startup_s=150.0, sglang_waiting_s=30.0, sglang_bootstrap_s=30.0)
HEAD_DIM = 8  # bf16: 16 bytes per head per token


def tp_scenario(prefill_tp: int, decode_tp: int, heads: int, chunks: int = 2) -> Scenario:
    """KV pages 1-3 -> 5-7 (two sends), aux row 1 -> 2, ``heads`` total KV heads."""
    return Scenario(
        name=f"tp{prefill_tp}->tp{decode_tp} {heads} kv head{'s' if heads > 1 else ''}",
        requests=[RequestSpec([1, 2, 3], [5, 6, 7], aux_index=1, dst_aux_index=2, send_chunks=chunks)],
        kv=KVPoolSpec(num_pages=9, head_num=heads, head_dim=HEAD_DIM),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        timeouts=FIVE_RANK_TIMEOUTS if prefill_tp + decode_tp >= 5 else TIMEOUTS,
    )


def swa_tp_scenario(prefill_tp: int, decode_tp: int, heads: int = 2) -> Scenario:
    """``tp_scenario`` with an SWA window cache of the same ``heads``: state pages 2, 3 -> 8, 9.

    The window cache is attention KV, so each rank holds its share of its heads as of
    the KV pool's (``patterns.rank_kv_heads``), and decode ranks check every element."""
    base = tp_scenario(prefill_tp, decode_tp, heads, chunks=1)
    return dataclasses.replace(
        base,
        name=f"kv+swa tp{prefill_tp}->tp{decode_tp} {heads} kv heads",
        requests=[dataclasses.replace(base.requests[0], state=[StateSpec("swa", [2, 3], [8, 9])])],
        state_pools=[StatePoolSpec(kind="swa", num_pages=12, head_num=heads, head_dim=HEAD_DIM)],
    )


def swa_host_scenario() -> Scenario:
    """TP 1 -> 1, SWA state from host memory: a good request, a length mismatch, a good one."""
    kind = "swa"
    return Scenario(
        name="swa state from host memory",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=0, dst_aux_index=1, state=[StateSpec(kind, [1, 2, 3], [4, 5, 6])]),
            RequestSpec([5, 6], [7, 8], aux_index=1, dst_aux_index=2, state=[StateSpec(kind, [7, 8, 9], [10, 11])]),
            RequestSpec([9], [10], aux_index=2, dst_aux_index=3, state=[StateSpec(kind, [12], [13])]),
        ],
        kv=KVPoolSpec(num_pages=12, head_num=2, head_dim=HEAD_DIM),
        state_pools=[StatePoolSpec(kind=kind, num_pages=16, head_dim=HEAD_DIM)],
        timeouts=TIMEOUTS,
    )


def layout_scenario() -> Scenario:
    """3 KV heads, prefill TP 1 -> decode TP 2: decode TP 2 cannot hold 3 heads."""
    scn = tp_scenario(1, 2, 3, chunks=1)
    scn.name = "3 kv heads to decode tp 2 refused"
    scn.hidden_size = 96  # the model config needs hidden_size % attention heads == 0
    return scn


# -- pass criteria ------------------------------------------------------------


def all_ok(result) -> bool:
    return result.ok


# A request that must fail ends Failed on both sides, each with a reason, within
# half of SGLang's own (shortened) waiting/bootstrap timeouts: a side that ended
# only through those timeouts waited the failure out, nobody told it.
FAILED_WITHIN_S = min(TIMEOUTS.sglang_waiting_s, TIMEOUTS.sglang_bootstrap_s) / 2


def swa_ok(result) -> bool:
    """Requests 0 and 2 transfer every byte; request 1 (3 vs 2 pages) ends Failed on both sides, fast."""
    if result.error or len(result.requests) != 3:
        return False
    good = result.requests[0].ok and result.requests[2].ok
    # Well under SGLang's own waiting timeout: decode was told, it did not time out.
    return good and result.requests[1].failed_within(FAILED_WITHIN_S)


def swa_host_ok(result) -> bool:
    """The host-memory part alone: request 0 transferred."""
    return not result.error and bool(result.requests) and result.requests[0].ok


def swa_mismatch_ok(result) -> bool:
    return not result.error and len(result.requests) > 1 and result.requests[1].failed_within(FAILED_WITHIN_S)


def layout_ok(result) -> bool:
    """Both sides Failed quickly, and the reason names the numbers."""
    if not result.requests:
        return False
    r = result.requests[0]
    reason = " ".join(filter(None, [r.prefill_failure_reason, r.decode_failure_reason]))
    return r.failed_within(FAILED_WITHIN_S) and "3 KV heads" in reason and "2" in reason


# -- the table ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NixlScenario:
    name: str
    build: Callable[[], Scenario]
    passed: Callable = all_ok
    # "fail" / "pass": what stock does on a release, from its policy.
    stock_expectation: Callable[[releases.ReleasePolicy], str] = lambda policy: "pass"
    stock_shim: bool = True  # stock runs get the host-memory shim (see module docstring)
    decode_backend_for_ext: Optional[str] = None  # mixed run: ext prefill, this decode
    fix: str = "F4"
    # -ext runs get the shim too (F11 on 0.5.23: -ext keeps stock's memory handling).
    ext_shim: bool = False
    # A test-only prefill hook in test/support/prefill_faults.py that both runs get ("" = none).
    prefill_hook: str = ""
    # The same for each decode rank's manager (SGLANG_HARNESS_DECODE_MANAGER_HOOK).
    decode_hook: str = ""

    def stock_env(self) -> Optional[Dict[str, str]]:
        return {nixl_shim.ENV: "1"} if self.stock_shim else None

    def ext_env(self) -> Optional[Dict[str, str]]:
        # A stock decode in a mixed run needs the shim to register host memory.
        return {nixl_shim.ENV: "1"} if self.decode_backend_for_ext or self.ext_shim else None


def stock_slice_uses_total_heads() -> bool:
    """Whether stock ``send_kvcache_slice`` reads ``total_kv_head_num`` (``releases.features()``)."""
    return releases.features().stock_nixl_slice_uses_total_heads


def stock_slice_maps_decode_replicas_by_modulo() -> bool:
    """Whether stock maps decode-side head replicas by modulo (``releases.features()``)."""
    return releases.features().stock_nixl_slice_maps_decode_replicas_by_modulo


def stock_kv_tag_sender_field() -> Optional[str]:
    """The ``kv_args`` field stock puts last in its KV notification tag (``releases.features()``)."""
    return releases.features().stock_nixl_kv_tag_sender_field


# -- stock expectations, per scenario (what stock does where F4 is live) ---------


def _fail_if(live_and: bool, policy) -> str:
    return "fail" if policy.is_live("F4") and live_and else "pass"


def _stock_many_prefill_to_one_decode(policy) -> str:
    """P > D: decode completes only if each prefill rank sends its own key."""
    return _fail_if(stock_kv_tag_sender_field() != "engine_rank", policy)


def _stock_decode_replicated_single_head(policy) -> str:
    """One head over decode TP 2: per-rank head math gives 0 heads per decode rank."""
    return _fail_if(not stock_slice_uses_total_heads(), policy)


def _stock_decode_replicas_of_several_heads(policy) -> str:
    """A prefill rank with several heads serving decode ranks that replicate them."""
    return _fail_if(not stock_slice_uses_total_heads() or stock_slice_maps_decode_replicas_by_modulo(), policy)


def _stock_swa_across_tp(policy) -> str:
    """Non-MLA SWA state across TP sizes: stock NIXL raises per request up to 0.5.21
    (``releases.features().stock_swa_head_slice_backends``; 0.5.22 and 0.5.23 slice it)."""
    return "pass" if "nixl" in releases.features().stock_swa_head_slice_backends else "fail"


def _always_fail(policy) -> str:
    return "fail"


def _always_pass(policy) -> str:
    return "pass"


def builtin_scenarios() -> List[NixlScenario]:
    out = []
    for p, d in ((2, 1), (1, 2)):
        for h in (1, 2, 4):
            if p > d:
                expect = _stock_many_prefill_to_one_decode
            elif h < d:
                expect = _stock_decode_replicated_single_head
            else:
                expect = _always_pass
            out.append(NixlScenario(f"kv tp{p}->tp{d} h{h}", lambda p=p, d=d, h=h: tp_scenario(p, d, h), all_ok, expect))
    # 2 KV heads over decode TP 4 (each head on two decode ranks): see test_nixl_ext.py for the table.
    out.append(
        NixlScenario(
            "kv tp1->tp4 h2", lambda: tp_scenario(1, 4, 2, chunks=1), all_ok, _stock_decode_replicas_of_several_heads
        )
    )
    out.append(
        NixlScenario(
            "ext prefill, stock decode, tp2->tp1 h2",
            lambda: tp_scenario(2, 1, 2),
            all_ok,
            _always_pass,
            decode_backend_for_ext="nixl",
        )
    )
    for p, d in ((2, 1), (1, 2), (1, 4)):
        out.append(NixlScenario(f"kv+swa tp{p}->tp{d} h2", lambda p=p, d=d: swa_tp_scenario(p, d), all_ok,
                                _stock_swa_across_tp))
    out.append(NixlScenario("swa state from host memory", swa_host_scenario, swa_ok, _always_fail, stock_shim=False))
    out.append(NixlScenario("3 kv heads over decode tp 2", layout_scenario, layout_ok, _always_fail))
    return out


F13_TOPOLOGIES = ((2, 1), (1, 2), (1, 4))


def f13_scenarios() -> List[NixlScenario]:
    """F13 (0.5.13-0.5.21): the ``kv+swa`` rows of :func:`builtin_scenarios`, stock's classes under both
    names but ``-ext``'s ``maybe_send_extra``, and up to 0.5.16 KV to a decode that replicates heads.
    ``nixl_newest.nixl_scenarios`` adds F13's refusal and failure rows.
    The -ext runs get the host-memory shim as stock's do (``NixlSwaTpKVManager`` keeps stock's memory
    handling)."""
    out = [
        NixlScenario(f"kv+swa tp{p}->tp{d} h2", lambda p=p, d=d: swa_tp_scenario(p, d), all_ok,
                     _stock_swa_across_tp, fix="F13", ext_shim=True)
        for p, d in F13_TOPOLOGIES
    ]
    if not releases.features().stock_nixl_prep_serves_decode_replicas:
        # 0.5.13-0.5.16: stock's prepared KV slice lists cannot serve a decode that replicates heads.
        out.append(NixlScenario("kv tp1->tp4 h2 (decode replicas)", lambda: tp_scenario(1, 4, 2, chunks=1), all_ok,
                                _always_fail, fix="F13", ext_shim=True))
    return out


def by_name(name: str) -> NixlScenario:
    for s in builtin_scenarios():
        if s.name == name:
            return s
    raise KeyError(name)
