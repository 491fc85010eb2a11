"""Scenarios of the verified-transfer tests (``test_mooncake_verify``, ``test_nixl_verify``,
``test_mori_verify``): random valid transfers (page maps, lengths, empty included, chunking,
aux rows and the given state kinds, every index inside its pool), and the one-request
scenarios with the landed byte each flip case changes (pages derived by hand below).
Test-only; outside the wheel."""

import dataclasses
import os
import random
import re
from typing import Sequence

from support import plugin_metrics
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, StatePoolSpec, StateSpec, Timeouts

KV_PAGES, STATE_PAGES = 24, 12


def random_scenario(rng: random.Random, n: int, page_size: int, kinds: Sequence[str], name: str,
                    kv_heads=(2, 16), state_heads=(1, 16), prefill_tp: int = 1, decode_tp: int = 1,
                    min_pages: int = 0) -> Scenario:
    """``n`` requests of ``min_pages``-6 KV pages and ``min_pages``-4 pages of each paged state kind;
    ``kv_heads`` / ``state_heads``: (heads, head dim) of the KV and state pools.
    SGLang's bounds are :data:`RANKS`': a no-false-alarm run ends on checks, never on a timeout
    (CI once saw a TP 2 -> 1 room on 0.5.11 take 8.1 s under load, past the 8 s default)."""
    requests = []
    for _ in range(n):
        length = rng.randint(min_pages, 6)
        state = []
        for kind in kinds:
            s_len = 1 if kind == "mamba" else rng.randint(min_pages, 4)  # mamba: one slot to one slot
            state.append(StateSpec(kind, rng.sample(range(STATE_PAGES), s_len), rng.sample(range(STATE_PAGES), s_len)))
        requests.append(RequestSpec(
            rng.sample(range(KV_PAGES), length), rng.sample(range(KV_PAGES), length),
            aux_index=rng.randrange(8), dst_aux_index=rng.randrange(8), state=state, send_chunks=rng.randint(1, 3),
        ))
    return Scenario(
        name=name,
        requests=requests,
        page_size=page_size,
        kv=KVPoolSpec(num_pages=KV_PAGES, head_num=kv_heads[0], head_dim=kv_heads[1]),
        state_pools=[StatePoolSpec(kind=k, num_pages=STATE_PAGES, num_layers=2, head_num=state_heads[0],
                                   head_dim=state_heads[1]) for k in kinds],
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        timeouts=RANKS,
    )


HEADS, HEAD_DIM = 4, 8  # 4 heads: TP 1 -> 4 leaves one per decode rank
# Flip and stock-decode cases end on checks (Success, or Failed by the digest), never on a
# timeout: SGLang's bounds only end a room that hangs, so they need not be short.
SHORT = Timeouts(request_s=40, sglang_waiting_s=20, sglang_bootstrap_s=20)
# Several ranks a side start slower, more so beside another test (pytest -n 2): SGLang's own
# bootstrap and waiting bounds longer there, or a slow start reads as a failed room.
RANKS = Timeouts(request_s=60, sglang_waiting_s=20, sglang_bootstrap_s=20)


def one_request(name: str, p: int = 1, d: int = 1, kind=None, extra_layers: int = 0) -> Scenario:
    """KV pages 1-3 -> 6-8, aux row 1 -> 3, and optionally state pages 2, 4 -> 5, 9 of ``kind``
    (mamba: slot 2 -> 5); ``extra_layers``: decode's state pool has that many more layers."""
    state = [StateSpec(kind, [2] if kind == "mamba" else [2, 4], [5] if kind == "mamba" else [5, 9])] if kind else []
    pools = [StatePoolSpec(kind=kind, num_pages=12, num_layers=2, head_num=HEADS, head_dim=HEAD_DIM,
                           decode_extra_layers=extra_layers)] if kind else []
    return Scenario(
        name=name,
        requests=[RequestSpec([1, 2, 3], [6, 7, 8], aux_index=1, dst_aux_index=3, state=state)],
        kv=KVPoolSpec(num_pages=10, head_num=HEADS, head_dim=HEAD_DIM),
        state_pools=pools,
        prefill_tp=p,
        decode_tp=d,
        timeouts=SHORT if p == d == 1 else RANKS,
    )


def flip_cases(engine: str) -> dict:
    """case -> (scenario builder, component, decode buffer flipped, decode page flipped, prefill
    ranks the reason names), for every engine: KV buffer 1 (V of layer 0) page 7, the aux row's
    decode page 3, a state page of each kind (buffer 1 is layer 1, paged kinds' page 9 and
    mamba's slot 5; NSA buffer 0 page 5), and KV across TP sizes (2 -> 1: decode buffer 2, both
    prefill ranks named; 1 -> 2: buffer 0 page 8 on each decode rank)."""
    def case(label, *args, **kw):
        return lambda: one_request(f"{engine} verify {label}", *args, **kw)

    return {
        "kv": (case("kv"), "kv", 1, 7, "[0]"),
        "aux": (case("aux"), "aux", 0, 3, "[0]"),
        "swa": (case("swa", kind="swa"), "state0", 1, 9, "[0]"),
        "nsa": (case("nsa", kind="nsa"), "state0", 0, 5, "[0]"),
        "dsv4": (case("dsv4", kind="dsv4"), "state0", 1, 9, "[0]"),
        "mamba": (case("mamba", kind="mamba"), "state0", 1, 5, "[0]"),
        "kv tp2->1": (case("kv tp2->1", 2, 1), "kv", 2, 6, "[0, 1]"),
        "kv tp1->2": (case("kv tp1->2", 1, 2), "kv", 0, 8, "[0]"),
    }


# The stock and unverified sides of a flip case cost a run each (about 5 s one rank a side,
# 8 s with several ranks on a 2-core machine): CI runs them for a representative subset of
# each engine's cases (``two_sided_cases``), a long run for every case with this set to 1.
ALL_FLIP_SIDES_ENV = "SGLANG_DISAGG_EXT_ALL_FLIP_SIDES"


def two_sided_cases(cases: dict, subset: Sequence[str]) -> list:
    """The flip cases whose stock and unverified sides run: ``subset`` (in ``cases``' order), or
    every case where ``SGLANG_DISAGG_EXT_ALL_FLIP_SIDES=1``."""
    if os.environ.get(ALL_FLIP_SIDES_ENV, "") not in ("", "0"):
        return list(cases)
    missing = set(subset) - set(cases)
    if missing:
        raise ValueError(f"two-sided flip cases {sorted(missing)} are not cases")
    return [c for c in cases if c in subset]


def metric(text: str, sample: str, **labels) -> float:
    """``sglang_disagg_ext_<sample>`` with ``labels`` in one worker's metrics text (0 where never counted)."""
    return plugin_metrics.value(text, "sglang_disagg_ext_" + sample, **labels)


# The byte every flip hook changes in its block or page (inflight_flip: SGLANG_HARNESS_FLIP_OFFSET,
# default 1; the tests leave it there).
FLIP_OFFSET = 1


def pool_label(scn: Scenario, component: str) -> str:
    """The harness's name of decode pool ``component`` ("kv", "aux", "state<c>") in its mismatch
    lines: worker.py names state pools "state<c>:<kind>"."""
    if component.startswith("state"):
        return f"{component}:{scn.state_pools[int(component[len('state'):])].kind}"
    return component


def assert_harness_saw_the_flip(result, scn: Scenario, component: str, buffer: int, page: int) -> None:
    """The flip happened and landed: the harness's own byte check (independent of any digest)
    finds exactly one wrong byte per decode rank, in decode ``component`` buffer ``buffer`` page
    ``page`` at the flipped offset, and nothing else wrong. One rank a side compares whole pages
    ("... (1/<n> bytes differ, first at offset 1)"); several ranks compare each element of the
    heads a rank holds (byte 1 is token 0 of its first head: one element, one line per rank)."""
    (req,) = result.requests
    label = pool_label(scn, component)
    ranks = scn.decode_tp
    if component == "aux" or scn.prefill_tp == scn.decode_tp == 1:  # compared as whole pages
        line = re.compile(rf"(decode\d+: )?{re.escape(label)} buffer {buffer} page {page}: expected prefill page "
                          rf".*\(1/\d+ bytes differ, first at offset {FLIP_OFFSET}\)$")
        hit = [m for m in req.mismatches if line.match(m)]
    else:
        hit = [m for m in req.mismatches if f" {label} buffer {buffer} (" in m and f") page {page} token 0 head " in m]
    assert len(hit) == ranks and len(req.mismatches) == ranks, (label, buffer, page, req.mismatches)
    assert not req.bytes_verified, result.describe()


def assert_flip_unnoticed(result, scn: Scenario, component: str, buffer: int, page: int) -> None:
    """Stock or unverified: Success on both sides, and the harness's own byte check finds
    the one wrong byte in decode ``component`` buffer ``buffer`` page ``page``."""
    (req,) = result.requests
    assert req.decode_status == "Success" and req.prefill_status == "Success", result.describe()
    assert_harness_saw_the_flip(result, scn, component, buffer, page)


def assert_flip_failed_by_digest(result, component: str, buffer: int, ranks: str, prefill_told: bool, *,
                                 scn: Scenario, page: int) -> None:
    """Verified: Failed on every decode rank (each flipped its own copy of the page), each
    reason naming component, decode buffer and prefill rank(s), one mismatch counted per
    decode rank; prefill concluded Success before decode checked, and each prefill rank
    counts one notice per decode rank where it can hear them (``prefill_told``), else none.
    The notice reaches prefill after decode failed the room: the harness reads each
    worker's metrics at its exit. And the flip did land in decode page ``page`` of ``scn``'s
    pool, as the harness's own byte check saw (:func:`assert_harness_saw_the_flip`): the
    Failed is the flip's, not a digest that would fail anyway."""
    (req,) = result.requests
    assert "_V" in (result.decode_manager or "").rsplit(".", 1)[-1], result.describe()  # the composed class
    assert req.decode_status == "Failed" and req.prefill_status == "Success", result.describe()
    assert_harness_saw_the_flip(result, scn, component, buffer, page)
    decodes = [k for k in result.plugin_metrics if k.startswith("decode")]
    want = f"digest mismatch in component {component} buffer {buffer} from prefill rank(s) {ranks}"
    assert (req.decode_failure_reason or "").count(want) == len(decodes), req.decode_failure_reason
    for role, text in result.plugin_metrics.items():
        if role.startswith("decode"):
            assert metric(text, "verify_mismatches_total", component=component) == 1.0, (role, text)
        else:
            told = metric(text, "verify_mismatch_reports_total")
            assert told == (float(len(decodes)) if prefill_told else 0.0), (role, text)


def counted_ok(result) -> list:
    """``verified_transfers_total{result="ok"}`` of each decode rank, in rank order."""
    return [metric(v, "verified_transfers_total", result="ok") for k, v in sorted(result.plugin_metrics.items())
            if k.startswith("decode")]


FLIP_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inflight_flip.py") + ":flip_one_landed_byte"


def landed_flip_env(component: str, buffer: int, page: int, prefill_tp: int = 1) -> dict:
    """The decode hook that flips one landed byte (``inflight_flip.flip_one_landed_byte``) of
    decode ``component`` buffer ``buffer`` page ``page``, after all ``prefill_tp`` prefill
    ranks reported Success."""
    return {
        "SGLANG_HARNESS_DECODE_MANAGER_HOOK": FLIP_HOOK,
        "SGLANG_HARNESS_FLIP_COMPONENT": component,
        "SGLANG_HARNESS_FLIP_BUFFER": str(buffer),
        "SGLANG_HARNESS_FLIP_PAGE": str(page),
        "SGLANG_HARNESS_FLIP_AFTER_SUCCESSES": str(prefill_tp),
    }


def three_rooms(scn: Scenario) -> Scenario:
    """``scn``'s one request three times over, each with its own aux rows (metadata rows 0-2 -> 1-3)."""
    scn.requests = [dataclasses.replace(scn.requests[0], aux_index=i, dst_aux_index=i + 1) for i in range(3)]
    return scn


def assert_stock_decode_served(result) -> None:
    """A verifying ``-ext`` prefill with a stock decode: every room Success on both sides with
    every byte right (the decode's status thread never met a frame it could not read), nothing
    counted as verified on decode."""
    assert "_V" in (result.prefill_manager or "").rsplit(".", 1)[-1], result.describe()
    assert "sglang_disagg_ext" not in (result.decode_manager or ""), result.describe()
    assert len(result.requests) == 3 and result.ok, result.describe()
    assert all(r.decode_status == r.prefill_status == "Success" and r.bytes_verified for r in result.requests), \
        result.describe()
    assert "verified_transfers_total" not in result.plugin_metrics.get("decode", ""), result.plugin_metrics
