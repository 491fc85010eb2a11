"""What one harness run transfers: pure, JSON-serialisable dataclasses.

A :class:`Scenario` describes the pools both sides build (identical geometry on
prefill and decode) and a list of requests that run one after another through
one prefill process and one decode process. Nothing here imports SGLang, torch
or the code under test; :mod:`.patterns` derives the expected decode contents
from a scenario alone.

Page indices are pool pages (what SGLang's schedulers pass to ``send`` and
``send_metadata``), not token indices. Every page list may have any length,
including zero, and the two sides of a state component may differ in length.
A state page list may also be ``None``: that side then passes ``None`` for the
component (SGLang's "nothing to send for this component").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

STATE_KINDS = ("swa", "nsa", "dsv4", "mamba")
PAGED_STATE_KINDS = ("swa", "nsa", "dsv4")

# Pool ids used by the byte patterns (patterns.py): KV is 0, the aux
# (metadata) buffers 1, state component i is STATE_POOL_BASE + i.
KV_POOL_ID = 0
AUX_POOL_ID = 1
STATE_POOL_BASE = 2

KV_CHECKSUM_SIDES = ("none", "prefill", "decode", "both")
# What a soak request was made to suffer (``RequestSpec.fault``): "engine": one of
# its decode KV pages is in ``Scenario.dropped_kv_pages``, whose writes prefill's
# engine fails (``harness.faults``); "bad_index": a decode KV index outside the pool;
# "duplicate_room": it names the room of an earlier live request (F16); "never_admitted":
# prefill makes no sender for it (``RequestSpec.prefill_admits``, F17).
REQUEST_FAULTS = ("engine", "bad_index", "duplicate_room", "never_admitted", "mismatched_peer")
# The fault of a request served by the second decode process (Scenario.mismatched_decode_kv_head_dim).
MISMATCHED_PEER = "mismatched_peer"
NOT_ADMITTED = "NotAdmitted"  # the prefill status of a request prefill made no sender for (prefill_admits)

# A wave run's request record error starting with this: the SGLang call the worker
# makes for the request (``send`` / ``send_metadata``) raised into its caller. In a
# server that caller is the scheduler's event loop, so the soak counts it as a
# violation ("raised"), not as the request failing.
RAISED_INTO_CALLER = "raised into the caller: "


class ScenarioError(ValueError):
    """A scenario that cannot be run as written."""


@dataclasses.dataclass
class KVPoolSpec:
    """The full-attention KV pool: a real ``MHATokenToKVPool`` on CPU.

    Buffers are K for each layer then V for each layer (SGLang's
    ``get_contiguous_buf_infos`` order); page ``p`` of a buffer starts at
    ``p * page_size * head_num * head_dim * itemsize``. Pages ``0 ..
    num_pages - 1`` are addressable.
    """

    num_pages: int = 16
    head_num: int = 2
    head_dim: int = 16
    dtype: str = "bfloat16"


@dataclasses.dataclass
class StatePoolSpec:
    """One hybrid-state component, the same on both sides.

    Paged kinds (swa, nsa, dsv4) are a real ``MHATokenToKVPool`` of their own
    (what ``SWAKVPool.get_state_buf_infos`` hands to the transfer backend):
    ``2 * num_layers`` buffers of ``num_pages`` pages. A Mamba component is
    plain CPU tensors: for each entry of ``mamba_item_bytes``, ``num_layers``
    buffers of ``num_pages`` slots of that many bytes.
    """

    kind: str
    num_pages: int = 16
    num_layers: int = 1
    head_num: int = 1
    head_dim: int = 16
    dtype: str = "bfloat16"
    mamba_item_bytes: List[int] = dataclasses.field(default_factory=lambda: [192, 64])
    # Paged kinds: layers decode's pool has after prefill's ``num_layers`` (an
    # MTP/nextn draft layer at the tail). Its buffers are then K of
    # ``num_layers + decode_extra_layers`` layers, then V of as many.
    decode_extra_layers: int = 0

    @property
    def paged(self) -> bool:
        return self.kind in PAGED_STATE_KINDS

    def layers_on(self, role: str) -> int:
        """Layers of this component's pool on ``role`` ("prefill" or "decode")."""
        return self.num_layers + (self.decode_extra_layers if role == "decode" else 0)


@dataclasses.dataclass
class StateSpec:
    """One request's pages of one state component (same position as its pool)."""

    kind: str
    src_pages: Optional[List[int]] = dataclasses.field(default_factory=list)
    dst_pages: Optional[List[int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestSpec:
    """One transfer: prefill pages -> decode pages, one aux row, state pages.

    ``send_chunks`` splits the source KV pages over that many ``send`` calls
    (chunked prefill); state indices travel with the last chunk only, as in
    SGLang's prefill scheduler.
    """

    src_kv_pages: List[int]
    dst_kv_pages: List[int]
    aux_index: int = 0
    dst_aux_index: Optional[int] = None
    state: List[StateSpec] = dataclasses.field(default_factory=list)
    send_chunks: int = 1
    room: Optional[int] = None
    # Opt-in: decode-side indices (dst_kv_pages, dst_aux_index, state
    # dst_pages) may lie outside decode's pools, for tests of what a backend
    # does with such a request. Nothing is expected at such an index.
    allow_out_of_pool: bool = False
    # Decode waits this long, once bootstrapped, before it sends its metadata (a decode whose
    # pre-allocation waited for KV memory): with a prefill bootstrap timeout shorter than
    # this, prefill has dropped the room by the time decode's metadata arrives (F17).
    decode_metadata_delay_s: float = 0.0
    # False: prefill makes no sender for this request (the client's request to prefill was
    # refused before its scheduler); decode sends its metadata as usual (F17's lease). Prefill
    # records the status NOT_ADMITTED (one at a time: it waits for decode to end the room, or
    # the bound; in a wave the wave goes on without it).
    prefill_admits: bool = True
    # Decode's receiver and its pending-queue lookups name a bootstrap address that takes the
    # connection and never answers (a prefill behind a link that drops packets, F20), opened by
    # the decode worker. Needs prefill_admits=False (no prefill knows the request) and
    # decode_pending_queue.
    prefill_unanswered: bool = False
    # Decode ends the request before it reaches prefill's scheduler (its pre-allocation waited for
    # KV memory, then the client aborted): decode's receiver is made, bootstrapped (init) and aborted
    # before its metadata, so its ABORT goes out for a room prefill has not opened; prefill makes
    # its sender only once decode's result shows the room ended and, where the bootstrap loop hands
    # ABORTs to ``_handle_abort_notification``, that handler has taken decode's ABORT for it (the
    # reverse orphan: F17 on Mooncake, F23 on NIXL). Not with the pending queue or waves.
    decode_ends_first: bool = False
    # Set by the soak generator: the fault this request carries (REQUEST_FAULTS), so
    # that the harness knows which requests may end Failed. None: a valid request.
    fault: Optional[str] = None

    @property
    def decode_aux_index(self) -> int:
        return self.aux_index if self.dst_aux_index is None else self.dst_aux_index


# How long a prefill worker waits, after every rank is done, for the verification-mismatch
# notices the decode ranks say they sent it (worker._await_mismatch_notices); the parent
# lets a prefill outlive its decodes by a little more than this (run._wait_children).
MISMATCH_NOTICE_WAIT_S = 10.0


@dataclasses.dataclass
class Timeouts:
    """Bounds, in seconds. Every wait in the harness has one.

    ``request_s`` bounds each request on each side (worker poll loops);
    ``startup_s`` bounds imports, manager construction and the decode side's
    wait for the prefill to register at the bootstrap server. The ``sglang_*``
    values go to SGLang's own environment variables in the children, so that a
    stock hang ends as ``Failed`` (decode waiting timeout, prefill bootstrap
    timeout) well inside ``request_s``.

    The heartbeat values are looser than SGLang's defaults (5 s x 2): a decode
    marks its prefill down after ``heartbeat_max_failure`` consecutive
    ``/health`` checks that got no answer within 3 s, and with five engine
    processes on two cores a busy prefill missed two in a row (P1->D4, about
    one run in ten; decode then logs "Lost connection with prefill instance"
    and fails the room before any byte moves). No harness scenario tests the
    heartbeat; a dead prefill still ends every request through the waiting
    timeout.
    """

    request_s: float = 30.0
    startup_s: float = 120.0
    sglang_waiting_s: float = 8.0
    sglang_bootstrap_s: float = 8.0
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failure: int = 6
    # How long a prefill still in its requests may run once every decode is gone
    # (``run._wait_children``): nobody consumes its work, so only what it does about the
    # dead peer can still happen. A scenario that tests exactly that gives it longer;
    # prefill exits by itself when its rooms conclude, so a long bound costs nothing.
    decode_gone_s: float = 3.0


@dataclasses.dataclass
class Scenario:
    name: str
    requests: List[RequestSpec]
    page_size: int = 4
    num_layers: int = 2
    kv: KVPoolSpec = dataclasses.field(default_factory=KVPoolSpec)
    state_pools: List[StatePoolSpec] = dataclasses.field(default_factory=list)
    aux_rows: int = 8
    hidden_size: int = 64
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)
    room_base: int = 1000
    # Attention TP sizes (one process per rank). With either above 1,
    # ``kv.head_num`` is the model's total KV-head count and each rank's KV
    # pool holds its share (see ``patterns.rank_kv_heads``), and so does each
    # paged state pool of its own ``head_num`` (the only state kind allowed
    # then); run_scenario then runs one worker process per rank.
    prefill_tp: int = 1
    decode_tp: int = 1
    # Which sides build their metadata buffers with SGLang's optional KV-checksum
    # buffer (``MetadataBuffers(kv_checksum_enabled=True)``, what
    # ``--disaggregation-enable-kv-checksum`` gives; 0.5.23+): one of
    # KV_CHECKSUM_SIDES. On one side only, that side has one more aux buffer
    # (the last), which the other side's pools have no counterpart for.
    kv_checksum_on: str = "none"
    # Decode's ``MetadataBuffers`` hidden size when it differs from ``hidden_size``
    # (0: the same). SGLang sizes the hidden-state metadata buffer by the draft
    # model where an engine runs speculative decoding and at 16 elements where it
    # does not, so an engine pair configured differently registers buffers of the
    # same count with different row sizes.
    decode_hidden_size: int = 0
    # Decode's KV head dim when it differs from ``kv.head_dim`` (0: the same): a decode
    # serving another model configuration (F18). Its KV pages are then larger or smaller
    # than prefill's; one rank a side only.
    decode_kv_head_dim: int = 0
    # Decode asks for prefill's parallel info as SGLang's pending queue does
    # (``DecodePreallocQueue._ensure_prefill_info``: per request, after its receiver is made
    # and before its ``init``, once a second, at most 15 times, then the receiver aborted)
    # instead of waiting for it once at startup. For a prefill decode may never pair with
    # (F19: a newer release); one rank a side only.
    decode_pending_queue: bool = False
    # How many tries the stand-in pending queue makes before it aborts the receiver (stock: 15).
    pending_queue_tries: int = 15
    # Decode makes each request's receiver only once prefill has made that room's sender (prefill's
    # result file says so), for a scenario about what prefill does with decode's ABORT: SGLang's ABORT
    # handler drops an ABORT for a room prefill has no status for yet, so without this wait a refusal
    # that beats prefill's sender leaves the room to prefill's bootstrap timeout and the test is a race.
    # Only with decode_pending_queue.
    decode_waits_for_prefill_sender: bool = False
    # Decode's page size when it differs from ``page_size`` (0: the same): a decode started with
    # another ``--page-size`` (its server arguments and pools), which SGLang's pairing check
    # refuses before any transfer (F14). Only with decode_pending_queue (no byte may move).
    decode_page_size: int = 0
    # Requests run ``wave`` at a time on each side (all senders / receivers of a
    # wave made, then sent, then polled together; decode checks the wave's bytes
    # and resets its pools after it). 1: one after another. Multi-rank: each side's
    # ranks meet at a barrier once per wave.
    wave: int = 1
    # Decode KV pages whose writes prefill's transfer engine fails, as a link that
    # drops them would (``harness.faults.drop_engine_writes``); empty: no fault.
    dropped_kv_pages: List[int] = dataclasses.field(default_factory=list)
    # NIXL: prefill's agent fails every n-th transfer it posts (``harness.faults.fail_nixl_posts``;
    # each prefill rank counts its own posts), in every wave but the last and the one whose
    # decode is killed; 0: no fault.
    fail_every_nth_post: int = 0
    # NIXL, several prefill ranks: this prefill rank's agent fails every aux row it posts
    # (``fail_nixl_posts(mgr, 1, kind="aux")``), in the same waves; the other ranks post
    # theirs. None: no fault.
    fail_aux_posts_of_prefill_rank: Optional[int] = None
    # Either NIXL fault: a failed post reads "PROC" this many seconds before "ERR".
    failed_post_err_after_s: float = 0.0
    # Wave runs: the decode worker kills itself (SIGKILL) in this wave, after sending
    # the metadata of half its requests, and the harness starts a new decode process
    # (a new engine and session, registering afresh) that serves the waves after it.
    restart_decode_in_wave: Optional[int] = None
    # Requests may name the same bootstrap room (``RequestSpec.room``): F16's duplicates, in one
    # wave so that both are live at once. Then the pages of a request that did not succeed must
    # still hold the sentinel (``patterns.wave_expectations``): a refused request writes nothing.
    shared_rooms: bool = False
    # Wave runs: the requests whose fault is MISMATCHED_PEER are served by a second decode
    # process beside the first (its own engine and Mooncake session, registering with the same
    # prefill: another model configuration joining the pool, F18) whose KV head dim is this;
    # prefill serves both at once. 0: no second decode. One rank a side; a refused request
    # must write nothing there (``patterns.wave_expectations``).
    mismatched_decode_kv_head_dim: int = 0

    @property
    def fails_posts(self) -> bool:
        """Whether some prefill rank's NIXL agent fails posts (either NIXL fault)."""
        return bool(self.fail_every_nth_post) or self.fail_aux_posts_of_prefill_rank is not None

    @property
    def multi_rank(self) -> bool:
        return self.prefill_tp > 1 or self.decode_tp > 1

    @property
    def has_mismatched_peer(self) -> bool:
        return any(r.fault == MISMATCHED_PEER for r in self.requests)

    def mismatched_peer_scenario(self) -> "Scenario":
        """The scenario the second decode process runs: this one, with its KV head dim."""
        return dataclasses.replace(self, decode_kv_head_dim=self.mismatched_decode_kv_head_dim)

    # -- derived -------------------------------------------------------------
    def room_of(self, index: int) -> int:
        req = self.requests[index]
        return req.room if req.room is not None else self.room_base + index

    def waves(self) -> List[List[int]]:
        """Request indices, ``wave`` at a time, in order."""
        n = len(self.requests)
        return [list(range(i, min(n, i + self.wave))) for i in range(0, n, self.wave)]

    def kv_buffer_count(self) -> int:
        return 2 * self.num_layers

    def validate(self) -> None:
        if self.page_size < 1:
            raise ScenarioError(f"{self.name}: page_size must be >= 1")
        if self.num_layers < 1:
            raise ScenarioError(f"{self.name}: num_layers must be >= 1")
        if self.kv.num_pages < 1:
            raise ScenarioError(f"{self.name}: kv.num_pages must be >= 1")
        for i, pool in enumerate(self.state_pools):
            if pool.kind not in STATE_KINDS:
                raise ScenarioError(
                    f"{self.name}: state pool {i} has unknown kind {pool.kind!r} "
                    f"(known: {', '.join(STATE_KINDS)})"
                )
            if pool.num_pages < 1 or pool.num_layers < 1:
                raise ScenarioError(f"{self.name}: state pool {i} needs num_pages, num_layers >= 1")
            if pool.decode_extra_layers < 0 or (pool.decode_extra_layers and not pool.paged):
                raise ScenarioError(f"{self.name}: state pool {i}: decode_extra_layers needs a paged kind, >= 0")
        if self.kv_checksum_on not in KV_CHECKSUM_SIDES:
            raise ScenarioError(
                f"{self.name}: kv_checksum_on {self.kv_checksum_on!r} not one of {', '.join(KV_CHECKSUM_SIDES)}"
            )
        h = self.decode_hidden_size
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ScenarioError(f"{self.name}: decode_hidden_size must be 0 (as prefill) or an int >= 1, got {h!r}")
        d = self.decode_kv_head_dim
        if isinstance(d, bool) or not isinstance(d, int) or d < 0 or (d and self.multi_rank):
            raise ScenarioError(
                f"{self.name}: decode_kv_head_dim must be 0 (as prefill) or an int >= 1, one rank a side; got {d!r}"
            )
        p = self.decode_page_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 0 or (p and not self.decode_pending_queue):
            raise ScenarioError(f"{self.name}: decode_page_size must be 0 (as prefill) or an int >= 1, "
                                f"with decode_pending_queue; got {p!r}")
        t = self.pending_queue_tries
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ScenarioError(f"{self.name}: pending_queue_tries must be an int >= 1, got {t!r}")
        if self.decode_waits_for_prefill_sender and not self.decode_pending_queue:
            raise ScenarioError(f"{self.name}: decode_waits_for_prefill_sender needs decode_pending_queue")
        if self.decode_pending_queue and (self.multi_rank or self.wave != 1):
            raise ScenarioError(f"{self.name}: decode_pending_queue runs one rank a side, one request at a time")
        _check_ranks(self)
        m = self.mismatched_decode_kv_head_dim
        if self.has_mismatched_peer and (isinstance(m, bool) or not isinstance(m, int) or m < 1
                                         or m == self.kv.head_dim or self.multi_rank or self.wave < 2):
            raise ScenarioError(f"{self.name}: mismatched_peer requests need mismatched_decode_kv_head_dim >= 1 and "
                                f"unlike prefill's {self.kv.head_dim}, waves, one rank a side; got {m!r}")
        if isinstance(self.wave, bool) or not isinstance(self.wave, int) or self.wave < 1:
            raise ScenarioError(f"{self.name}: wave must be an int >= 1, got {self.wave!r}")
        n = self.fail_every_nth_post
        if isinstance(n, bool) or not isinstance(n, int) or n == 1 or n < 0:
            raise ScenarioError(f"{self.name}: fail_every_nth_post must be 0 (off) or an int >= 2, got {n!r}")
        r = self.fail_aux_posts_of_prefill_rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.prefill_tp or n):
            raise ScenarioError(f"{self.name}: fail_aux_posts_of_prefill_rank must be a prefill rank in "
                                f"[0, {self.prefill_tp}) and excludes fail_every_nth_post, got {r!r}")
        e = self.failed_post_err_after_s
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < self.timeouts.request_s:
            raise ScenarioError(f"{self.name}: failed_post_err_after_s must be in [0, {self.timeouts.request_s}) s, "
                                f"got {e!r}")
        if self.fails_posts and self.dropped_kv_pages:
            raise ScenarioError(f"{self.name}: fail_every_nth_post (NIXL) and dropped_kv_pages (Mooncake) exclude "
                                f"each other")
        if self.multi_rank and (self.dropped_kv_pages or self.restart_decode_in_wave is not None):
            # harness.faults sizes a decode page from prefill's (equal TP); the restart
            # replaces the one decode process of a 1x1 run.
            raise ScenarioError(f"{self.name}: dropped_kv_pages and restart_decode_in_wave need one rank a side "
                                f"(prefill_tp {self.prefill_tp}, decode_tp {self.decode_tp})")
        if self.wave > 1 and self.aux_rows < self.wave:
            raise ScenarioError(f"{self.name}: wave {self.wave} needs at least as many aux rows ({self.aux_rows})")
        _check_pages(self, "dropped_kv_pages", self.dropped_kv_pages, self.kv.num_pages)
        k = self.restart_decode_in_wave
        if k is not None and (self.wave < 2 or isinstance(k, bool) or not isinstance(k, int)
                              or not 0 <= k < len(self.waves()) - 1):
            raise ScenarioError(f"{self.name}: restart_decode_in_wave {k!r} needs wave >= 2 and a wave "
                                f"in [0, {len(self.waves()) - 1}) (one must follow it)")
        rooms = set()
        for r, req in enumerate(self.requests):
            room = self.room_of(r)
            if room in rooms and not self.shared_rooms:
                raise ScenarioError(f"{self.name}: request {r} reuses bootstrap room {room}")
            rooms.add(room)
            _check_pages(self, f"request {r} src_kv_pages", req.src_kv_pages, self.kv.num_pages)
            dst_limit = None if req.allow_out_of_pool else self.kv.num_pages
            _check_pages(self, f"request {r} dst_kv_pages", req.dst_kv_pages, dst_limit)
            for label, idx in (("aux_index", req.aux_index), ("dst_aux_index", req.decode_aux_index)):
                if label == "dst_aux_index" and req.allow_out_of_pool and isinstance(idx, int):
                    continue
                if not 0 <= idx < self.aux_rows:
                    raise ScenarioError(f"{self.name}: request {r} {label} {idx} not in [0, {self.aux_rows})")
            if req.fault is not None and req.fault not in REQUEST_FAULTS:
                raise ScenarioError(f"{self.name}: request {r} fault {req.fault!r} not one of {REQUEST_FAULTS}")
            if req.send_chunks < 1:
                raise ScenarioError(f"{self.name}: request {r} send_chunks must be >= 1")
            if not req.prefill_admits and self.multi_rank:
                raise ScenarioError(f"{self.name}: request {r} prefill_admits=False is for one rank a side only")
            if req.decode_ends_first and (self.decode_pending_queue or self.wave != 1 or not req.prefill_admits):
                raise ScenarioError(f"{self.name}: request {r}: decode_ends_first runs one request at a time, "
                                    f"without the pending queue, on a prefill that admits it")
            if req.prefill_unanswered and (req.prefill_admits or not self.decode_pending_queue):
                raise ScenarioError(f"{self.name}: request {r} prefill_unanswered needs prefill_admits=False "
                                    f"and decode_pending_queue")
            if req.decode_metadata_delay_s < 0 or (req.decode_metadata_delay_s and self.wave > 1):
                raise ScenarioError(f"{self.name}: request {r} decode_metadata_delay_s must be >= 0, "
                                    f"and is for one-at-a-time scenarios only (wave {self.wave})")
            if len(req.state) != len(self.state_pools):
                raise ScenarioError(
                    f"{self.name}: request {r} lists {len(req.state)} state components, "
                    f"the scenario has {len(self.state_pools)} state pools"
                )
            for c, (st, pool) in enumerate(zip(req.state, self.state_pools)):
                if st.kind != pool.kind:
                    raise ScenarioError(
                        f"{self.name}: request {r} state {c} is {st.kind!r}, pool {c} is {pool.kind!r}"
                    )
                for side, pages in (("src_pages", st.src_pages), ("dst_pages", st.dst_pages)):
                    if pages is not None:
                        limit = None if side == "dst_pages" and req.allow_out_of_pool else pool.num_pages
                        _check_pages(self, f"request {r} state {c} {side}", pages, limit)

    # -- JSON ----------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Scenario":
        data = dict(data)
        data["kv"] = KVPoolSpec(**data.get("kv", {}))
        data["state_pools"] = [StatePoolSpec(**p) for p in data.get("state_pools", [])]
        data["timeouts"] = Timeouts(**data.get("timeouts", {}))
        reqs = []
        for r in data.get("requests", []):
            r = dict(r)
            r["state"] = [StateSpec(**s) for s in r.get("state", [])]
            reqs.append(RequestSpec(**r))
        data["requests"] = reqs
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Scenario":
        return cls.from_dict(json.loads(text))


def _check_ranks(scn: Scenario) -> None:
    for side in ("prefill_tp", "decode_tp"):
        value = getattr(scn, side)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScenarioError(f"{scn.name}: {side} must be an int >= 1, got {value!r}")
    if not scn.multi_rank:
        return
    # Paged state pools (an SWA window cache) are attention KV: each rank holds
    # its share of the pool's ``head_num`` heads, placed as the KV heads are
    # (patterns.rank_kv_heads). Mamba state is sharded by other rules, and a
    # decode-only draft layer is a single-rank question; neither is modelled.
    for i, pool in enumerate(scn.state_pools):
        if not pool.paged or pool.decode_extra_layers:
            raise ScenarioError(
                f"{scn.name}: multi-rank scenarios carry paged state pools without decode_extra_layers only; "
                f"state pool {i} is {pool.kind!r} with decode_extra_layers={pool.decode_extra_layers}"
            )


def _check_pages(scn: Scenario, label: str, pages, num_pages: Optional[int]) -> None:
    """Every page an int in [0, num_pages); ``num_pages`` None: any int (``allow_out_of_pool``)."""
    for p in pages:
        if not isinstance(p, int) or isinstance(p, bool):
            raise ScenarioError(f"{scn.name}: {label}: page {p!r} is not an int")
        if num_pages is not None and not 0 <= p < num_pages:
            raise ScenarioError(f"{scn.name}: {label}: page {p} not in [0, {num_pages})")


# -- small builders used by tests and the CLI ---------------------------------


def kv_only(name: str = "kv-only", n_pages: int = 5, **kw) -> Scenario:
    """One request, ``n_pages`` KV pages to different decode pages."""
    req = RequestSpec(
        src_kv_pages=list(range(1, 1 + n_pages)),
        dst_kv_pages=list(range(2 + n_pages, 2 + 2 * n_pages)),
        aux_index=1,
        dst_aux_index=3,
    )
    kw.setdefault("kv", KVPoolSpec(num_pages=2 + 2 * n_pages + 2))
    return Scenario(name=name, requests=[req], **kw)


def with_state(
    name: str,
    kind: str,
    src_pages: Optional[List[int]],
    dst_pages: Optional[List[int]],
    n_kv_pages: int = 4,
    state_pool_pages: int = 16,
    **kw,
) -> Scenario:
    """One request with KV pages plus one state component of ``kind``."""
    req = RequestSpec(
        src_kv_pages=list(range(1, 1 + n_kv_pages)),
        dst_kv_pages=list(range(1 + n_kv_pages, 1 + 2 * n_kv_pages)),
        aux_index=2,
        dst_aux_index=5,
        state=[StateSpec(kind, src_pages, dst_pages)],
    )
    kw.setdefault("kv", KVPoolSpec(num_pages=2 + 2 * n_kv_pages))
    pools = [StatePoolSpec(kind=kind, num_pages=state_pool_pages)]
    return Scenario(name=name, requests=[req], state_pools=pools, **kw)
