"""F10 scenarios (decode's metadata gate gets a deadline), stock vs ext, in this process.

Narrowest boundary: SGLang's own decode transfer queue. Each run builds one
``DecodeTransferQueue`` holding one request and calls its real
``pop_transferred()`` every few milliseconds, as the decode scheduler does once
per iteration. Everything on the path the fix touches is SGLang's code:

* ``pop_transferred`` -> ``_poll_with_metadata_gate`` -> ``utils.poll_and_all_reduce``
  -> the metadata gate (``utils._apply_metadata_gate``, or the plugin's
  :func:`~sglang_disagg_ext.backends.common.metadata_gate.gate_with_deadline` in the
  ext run) -> the MIN all-reduce over a real one-rank gloo process group;
* the request's receiver is a real ``MooncakeKVReceiver`` (its own ``__init__``
  and ``poll``), whose room reaches Success through the manager's real
  decode-side handler of prefill's status message (``apply_prefill_status``,
  0.5.20+; see below for older releases);
* a real ``MetadataBuffers`` (CPU), a real ``ReqToMetadataIdxAllocator``, a real
  ``Req`` in a real ``DecodeRequest``; a landing row is written with the
  buffers' own ``set_buf``; Failed is handled by the queue's own Failed branch
  (``failure_exception``, ``prepare_abort``, ``clear_slot``, slot freed) and
  Success by its own ``_commit_transfer_to_req``.

Minimal stand-ins, only for what needs a running server:

* the manager is a ``MooncakeKVManager`` made without ``__init__`` (which binds
  sockets, starts threads and a transfer engine); it holds only the decode-side
  room tables its receiver and status handler use, set as ``__init__`` sets
  them on decode, plus ``required_prefill_response_num_table[room] = 1`` as
  ``receiver.init`` sets it from a one-rank prefill, and (0.5.13-0.5.19, whose
  receiver asks for it in ``__init__``) an engine that only answers
  ``get_session_id``;
* before 0.5.20 the decode side handles prefill's status inline in the
  manager's ``decode_thread`` loop (a socket read, no method to call); there
  the scenario does what that loop's Success branch does for a one-rank prefill
  (the rank into ``prefill_response_tracker``, then ``update_status(room,
  Success)``, 0.5.13 mooncake/conn.py:1516-1531). The gate, the fix's
  boundary, sees the same Success either way;
* the queue is made without ``__init__`` (which reads the parallel and disagg
  config a server publishes); its attributes are set as ``__init__`` sets them
  for one attention-TP rank, without host receive, staging or deferred release;
* the scheduler is a namespace with the five things the queue reads from it
  (hicache off, metrics off, no checksum, an output streamer that records, a
  reasoning-token hook that does nothing, the server args the 0.5.13-0.5.18
  gate reads for its fake-transfer check); the tree cache only has ``unlock``;
  releasing the request's KV pages (``_release_request`` from 0.5.22, the
  decode module's ``release_kv_cache`` before it; both free pages through the
  tree cache) records the call instead.

Cases (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` set to a short deadline):

* ``lost``: the transfer reports Success, the metadata row never lands. Stock:
  still in the queue, its gate poll Transferring, after 3x the deadline (the
  live bug). Ext: Failed once the deadline has passed, within a margin, with
  the reason (room, metadata buffer index, seconds) in the abort message, the
  metadata slot freed and the KV released once.
* ``landed``: the request waits longer than the deadline *before* Success (a
  slow transfer), then its row lands part of a deadline after Success. Both
  stock and ext commit it with the row's token: the deadline counts from the
  gate's hold, not from queue entry, and a row that lands in time is never cut.

In both cases the other metadata rows (two other requests' metadata) must be
unchanged. ``metadata_gate_rows()`` is what ``sglang-disagg-ext selftest``
shows for F10.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import types
from typing import Callable, Dict, List, Optional

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.common.metadata_gate import metadata_gate_deadline
from sglang_disagg_ext.core.gate_deadline import WAITING_TIMEOUT_ENV

DEADLINE_S = 1  # SGLang reads the timeout as an integer (EnvInt)
# Stock must still hold the request after this many deadlines; a row polls no longer than that,
# so ext's bound (deadline + EXT_MARGIN_S) stays below it.
STOCK_BOUND_FACTOR = 5
# ext ends the request within deadline + this. Load only, never a second chance: a clean-clone
# CI run on 0.5.10.post1 (4 test workers on 2 cores, other tests beside them) ended it 2.578 s
# after Success, past the former 1.5 s margin (the rows then polled 3 deadlines).
EXT_MARGIN_S = 3.0
POLL_S = 0.01  # between two pop_transferred calls
ROOM = 7_000_123
OTHER_ROOMS = (7_000_001, 7_000_002)  # rows of two other requests, never to change
TOKEN = 31  # the first output token the landing row carries
HIDDEN_SIZE = 16
METADATA_ROWS = 4

# The scenario needs one process group; a real one-rank gloo group, made once.
_group_lock = threading.Lock()
_group = None


def _one_rank_group():
    global _group
    with _group_lock:
        if _group is None:
            import torch.distributed as dist

            # Not the default group: nothing process-wide is initialised.
            _group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        return _group


@contextlib.contextmanager
def waiting_timeout(seconds: int):
    """``SGLANG_DISAGGREGATION_WAITING_TIMEOUT=seconds`` for the block (SGLang reads it on every ``get``)."""
    old = os.environ.get(WAITING_TIMEOUT_ENV)
    os.environ[WAITING_TIMEOUT_ENV] = str(int(seconds))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(WAITING_TIMEOUT_ENV, None)
        else:
            os.environ[WAITING_TIMEOUT_ENV] = old


@dataclasses.dataclass
class GateReport:
    case: str
    outcome: str = "queued"  # "transferred" | "failed" | "queued" (still held at the bound)
    seconds: Optional[float] = None  # from Success to leaving the queue (or to the bound)
    deadline_s: float = DEADLINE_S
    receiver_poll: Optional[str] = None  # what the receiver itself says at the end (stock: Success)
    gate_poll: Optional[str] = None  # stock, still queued: what the gate makes of it
    row_room: Optional[int] = None  # metadata_buffers.bootstrap_room[index, 0] at the end
    metadata_index: Optional[int] = None
    abort_message: Optional[str] = None
    committed_output_ids: List[int] = dataclasses.field(default_factory=list)
    released: int = 0  # _release_request calls (KV pages freed)
    streamed: int = 0  # output_streamer.stream_output calls (the client told)
    slot_freed: bool = False
    others_unchanged: bool = False
    # Manager tables still holding the room after it left the queue (a failure
    # record left behind would be adopted by a later request reusing the room).
    room_left_in: List[str] = dataclasses.field(default_factory=list)
    error: Optional[str] = None

    @property
    def first_failure(self) -> Optional[str]:
        return None if self.passed else self.describe()

    def describe(self) -> str:
        return (
            f"{self.case}: {self.outcome} after {self.seconds}s (deadline {self.deadline_s}s); "
            f"receiver {self.receiver_poll}, gate {self.gate_poll}, row room {self.row_room}, "
            f"abort {self.abort_message!r}, released {self.released}, slot freed {self.slot_freed}, "
            f"other rows unchanged {self.others_unchanged}, room left in {self.room_left_in}"
            + (f"; error {self.error}" if self.error else "")
        )

    @property
    def passed(self) -> bool:
        """What a fixed gate does in this case (the expectations are the module docstring's)."""
        if self.error is not None or not self.others_unchanged or self.room_left_in:
            return False
        if self.case == "landed":
            return (
                self.outcome == "transferred" and self.committed_output_ids == [TOKEN] and self.abort_message is None
                and self.released == 0 and self.slot_freed
            )
        return ext_lost_problem(self) is None


def ext_lost_problem(report: GateReport, margin_s: float = EXT_MARGIN_S) -> Optional[str]:
    """None when ``report`` (case ``lost``) shows the request failed by the deadline, else what is wrong."""
    if report.outcome != "failed":
        return f"request {report.outcome}, not failed"
    if report.seconds is None or not (report.deadline_s <= report.seconds <= report.deadline_s + margin_s):
        return f"failed after {report.seconds}s, not within [{report.deadline_s}, {report.deadline_s + margin_s}]s"
    msg = report.abort_message or ""
    wanted = [
        "Decode transfer failed",  # the queue's own Failed branch built the message
        "decode metadata gate",
        f"room {ROOM}'s KV transfer reported Success but its metadata never landed",
        f"metadata buffer index {report.metadata_index} of {METADATA_ROWS}",
        f"deadline {report.deadline_s:g}s, {WAITING_TIMEOUT_ENV}",
    ]
    missing = [w for w in wanted if w not in msg]
    if missing:
        return f"abort message {msg!r} lacks {missing}"
    if report.released != 1 or report.streamed != 1 or not report.slot_freed:
        return f"released {report.released}x, streamed {report.streamed}x, slot freed {report.slot_freed}"
    return None


def stock_lost_signature(report: GateReport) -> Optional[str]:
    """None when a stock ``lost`` report shows exactly the live F10 bug, else why not.

    The bug: after 3x the deadline the request is still in the transfer queue,
    its receiver says Success, the gate turns that into Transferring because
    the row still shows room 0, and nothing was aborted, released or freed.
    """
    if report.error is not None:
        return f"stock crashed ({report.error}); the live bug raises nothing, it waits"
    problems = []
    if report.outcome != "queued":
        problems.append(f"request {report.outcome}")
    if report.seconds is None or report.seconds < STOCK_BOUND_FACTOR * report.deadline_s:
        problems.append(f"checked after {report.seconds}s only")
    if report.receiver_poll != "Success":
        problems.append(f"receiver polls {report.receiver_poll}")
    if report.gate_poll != "Transferring":
        problems.append(f"gate gives {report.gate_poll}")
    if report.row_room != 0:
        problems.append(f"row shows room {report.row_room}")
    if report.abort_message is not None or report.released or report.streamed or report.slot_freed:
        problems.append("the request was ended")
    return "; ".join(problems) or None


# --------------------------------------------------------------------------
# Building the real objects
# --------------------------------------------------------------------------


def _manager(waiting_timeout_s: int):
    """A decode ``MooncakeKVManager`` holding only its room tables (see the module docstring)."""
    from collections import defaultdict

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    from sglang.srt.disaggregation.utils import DisaggregationMode

    mgr = object.__new__(MooncakeKVManager)
    # As CommonKVManager.__init__ sets them on decode (0.5.23 common/conn.py:405-492).
    mgr.disaggregation_mode = DisaggregationMode.DECODE
    mgr.request_status = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr._staging_outstanding = defaultdict(int)
    mgr.defer_decode_allocation = False
    mgr.deferred_bootstrap = None
    mgr.enable_staging = False
    mgr._staging_handler = None
    mgr.required_prefill_response_num_table = {}
    # defaultdict(set) up to 0.5.22, a plain dict in 0.5.23 (whose code only uses get,
    # setdefault and pop on it, which a defaultdict answers the same way).
    mgr.prefill_response_tracker = defaultdict(set)
    mgr.addr_to_rooms_tracker = defaultdict(set)
    mgr.enable_deferred_decode_kv_release = False
    mgr.waiting_timeout = waiting_timeout_s
    # 0.5.13-0.5.19: MooncakeKVReceiver.__init__ asks the transfer engine for its session id.
    mgr.engine = types.SimpleNamespace(get_session_id=lambda: "127.0.0.1:1")
    return mgr


def _deliver_success(mgr, room: int) -> None:
    """Prefill's one-rank "transfer done" message, handled on decode as the release does."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if releases.features().decode_status_handler:  # 0.5.20+: the decode thread's own handler
        mgr.apply_prefill_status(bootstrap_room=room, status=KVPoll.Success, prefill_rank=0)
        return
    # Before 0.5.20 that handler is inline in decode_thread's socket loop; its Success
    # branch for a one-rank prefill (see the module docstring).
    mgr.prefill_response_tracker[room].add(0)
    if len(mgr.prefill_response_tracker[room]) == mgr.required_prefill_response_num_table[room]:
        mgr.update_status(room, KVPoll.Success)


@contextlib.contextmanager
def _recorded_release(queue):
    """Record, instead of doing, the release of the request's KV pages (a tree cache's job).

    Yields the recorder. 0.5.22+ release through the queue's ``_release_request``;
    earlier releases call the decode module's ``release_kv_cache`` by name.
    """
    from sglang.srt.disaggregation import decode

    recorder = _Recorder()
    if releases.features().decode_queue_release_request:
        queue._release_request = recorder
        yield recorder
        return
    original = decode.release_kv_cache
    decode.release_kv_cache = recorder
    try:
        yield recorder
    finally:
        decode.release_kv_cache = original


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)


def _queue(metadata_buffers, allocator):
    """A real ``DecodeTransferQueue`` for one attention-TP rank (see the module docstring)."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    streamed = _Recorder()
    scheduler = types.SimpleNamespace(
        enable_decode_hicache=False,
        enable_hisparse=False,
        kv_checksum_computer=None,
        metrics_reporter=types.SimpleNamespace(enable_metrics=False),
        output_streamer=types.SimpleNamespace(stream_output=streamed),
        # Up to 0.5.12.x the queue reads these two on the scheduler itself.
        enable_metrics=False,
        stream_output=streamed,
        batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None),
        disagg_decode_prealloc_queue=None,
        hisparse_coordinator=None,
        # 0.5.13-0.5.18's gate skips fake transfers by the server's backend name.
        server_args=types.SimpleNamespace(disaggregation_transfer_backend="mooncake"),
    )
    queue = object.__new__(DecodeTransferQueue)
    queue.queue = []
    queue.gloo_group = _one_rank_group()
    queue.req_to_metadata_buffer_idx_allocator = allocator
    queue.tp_rank = 0
    queue.metadata_buffers = metadata_buffers
    queue.scheduler = scheduler
    queue.enable_host_receive = False
    queue.tree_cache = types.SimpleNamespace(unlock=lambda lock: None)
    queue.spec_algorithm = SpeculativeAlgorithm.NONE
    queue._skipped_checksum_signatures = set()
    queue.enable_staging = False
    queue.staging_handler = None
    queue.enable_deferred_kv_release = False
    queue.deferred_kv_release_timeout = 0
    queue._deferred_releases = []
    return queue


def build_metadata_buffers(rows: int = METADATA_ROWS, hidden_size: int = HIDDEN_SIZE):
    """A real CPU ``MetadataBuffers`` with ``rows`` rows (what the decode scheduler builds)."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    kwargs = dict(size=rows, hidden_size=hidden_size, hidden_states_dtype=torch.float32)
    if releases.features().metadata_buffers_sampling_mask:
        kwargs["max_sampling_mask_tokens"] = 16  # 0.5.13+; unused with sampling masks off
    return MetadataBuffers(**kwargs)


def _req(room: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        f"f10-{room}", "", [1, 2, 3], SamplingParams(max_new_tokens=4),
        bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=room,
    )


def _buffers_snapshot(buffers) -> Dict[str, object]:
    import torch

    return {k: v.clone() for k, v in vars(buffers).items() if isinstance(v, torch.Tensor)}


def _rows_unchanged(before: Dict[str, object], buffers, rows) -> bool:
    import torch

    for name, old in before.items():
        new = getattr(buffers, name)
        for r in rows:
            if not torch.equal(old[r], new[r]):
                return False
    return True


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------


def gate_scenario(ext: bool, case: str, deadline_s: int = DEADLINE_S) -> GateReport:
    """Run ``case`` ("lost" or "landed") with the F10 gate installed (``ext``) or stock."""
    if case not in ("lost", "landed"):
        raise ValueError(f"unknown case {case!r}")
    report = GateReport(case=case, deadline_s=deadline_s)
    with waiting_timeout(deadline_s), metadata_gate_deadline(enabled=ext):
        try:
            _run(report, case, deadline_s)
        except Exception as e:  # a crash on the path is a failure, reported as such
            report.error = f"{type(e).__name__}: {e}"
    return report


def _run(report: GateReport, case: str, deadline_s: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    from sglang_disagg_ext.selftest.harness.sglang_setup import poll_name
    from sglang_disagg_ext.selftest.scenarios.f5 import _meta_req  # what set_buf reads from a Req

    buffers = build_metadata_buffers()
    allocator = ReqToMetadataIdxAllocator(METADATA_ROWS)
    other_slots = [allocator.alloc() for _ in OTHER_ROOMS]
    for slot, room in zip(other_slots, OTHER_ROOMS):
        buffers.set_buf(_meta_req(slot, 5 + slot, HIDDEN_SIZE, room))
    idx = allocator.alloc()
    report.metadata_index = idx
    free_before = allocator.available_size()
    before = _buffers_snapshot(buffers)

    mgr = _manager(deadline_s)
    receiver = MooncakeKVReceiver(mgr, "127.0.0.1:8998", ROOM)  # its own __init__: room Bootstrapping
    mgr.required_prefill_response_num_table[ROOM] = 1  # receiver.init, one prefill rank
    mgr.update_status(ROOM, KVPoll.WaitingForInput)  # what send_metadata's bootstrap reply leads to
    req = _req(ROOM)
    decode_req = DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=idx)
    queue = _queue(buffers, allocator)
    with _recorded_release(queue) as released:
        queue.queue.append(decode_req)

        def pop() -> List:
            return queue.pop_transferred()

        transferred: List = []
        if case == "landed":
            # A slow transfer: queued for longer than the deadline before Success.
            t_slow = time.monotonic() + 1.2 * deadline_s
            while time.monotonic() < t_slow and queue.queue:
                transferred += pop()
                time.sleep(POLL_S)
            if not queue.queue:
                raise RuntimeError("the request left the queue before its transfer reported Success")
        # Prefill's "transfer done" message, through the manager's own decode-side handler.
        _deliver_success(mgr, ROOM)
        t_success = time.monotonic()
        lands_at = t_success + 0.6 * deadline_s if case == "landed" else None
        bound = t_success + STOCK_BOUND_FACTOR * deadline_s
        landed = False
        while queue.queue and time.monotonic() < bound:
            if lands_at is not None and not landed and time.monotonic() >= lands_at:
                # The row lands (what the aux transfer writes), before this iteration's poll.
                buffers.set_buf(_meta_req(idx, TOKEN, HIDDEN_SIZE, ROOM))
                landed = True
            transferred += pop()
            if queue.queue:
                time.sleep(POLL_S)
        report.seconds = round(time.monotonic() - t_success, 3)
        report.row_room = int(buffers.bootstrap_room[idx, 0].item())
        if decode_req.kv_receiver is not None:  # the queue drops it once the request leaves
            report.receiver_poll = poll_name(receiver.poll())
        if queue.queue:
            report.outcome = "queued"
            if not installed_here():  # stock only: the ext gate would act on what it is asked
                report.gate_poll = _stock_gate_poll(queue, decode_req)
        elif transferred:
            report.outcome = "transferred"
            report.committed_output_ids = list(req.output_ids)
        else:
            report.outcome = "failed"
        finished = req.finished_reason
        report.abort_message = getattr(finished, "message", None) if finished is not None else None
        report.released = len(released.calls)
        report.streamed = len(queue.scheduler.output_streamer.stream_output.calls)
        report.slot_freed = allocator.available_size() == free_before + 1
        report.others_unchanged = _rows_unchanged(before, buffers, other_slots)
        if not queue.queue:
            tables = ("request_status", "failure_records", "required_prefill_response_num_table", "prefill_response_tracker")
            report.room_left_in = [t for t in tables if ROOM in getattr(mgr, t)]


def _stock_gate_poll(queue, decode_req) -> str:
    """What stock's metadata gate makes of the request now: its gated poll (0.5.13+,
    ``_poll_with_metadata_gate``); up to 0.5.12.x, where the test sits in
    ``_commit_transfer_to_req`` after the all-reduce, "Transferring" when that method
    holds the request (returns False: the row shows room 0; nothing is changed then)."""
    from sglang_disagg_ext.selftest.harness.sglang_setup import poll_name

    if releases.features().metadata_gate_function:
        return poll_name(queue._poll_with_metadata_gate()[0])
    return "Transferring" if queue._commit_transfer_to_req(decode_req) is False else "Success"


def installed_here() -> bool:
    from sglang_disagg_ext.backends.common import metadata_gate

    return metadata_gate.installed()


# --------------------------------------------------------------------------
# Rows for `sglang-disagg-ext selftest`
# --------------------------------------------------------------------------


def metadata_gate_row_names() -> List[str]:
    """The scenario names of ``metadata_gate_rows``, in order."""
    return [
        "metadata never lands: Failed at the waiting timeout",
        "metadata lands after a slow transfer: committed",
    ]


def _word(passed: Optional[bool]) -> str:
    return "n/a" if passed is None else ("pass" if passed else "fail")


def _row(name: str, run: Callable[[bool], GateReport], stock_expected: str,
         signature: Optional[Callable[[GateReport], Optional[str]]]) -> Dict:
    from sglang_disagg_ext.selftest.rows import make_row

    t0 = time.perf_counter()
    notes: List[str] = []
    s, e = run(False), run(True)
    stock, ext = s.passed, e.passed
    if signature is not None:
        not_the_bug = signature(s)
        if not_the_bug:
            notes.append(f"stock failure is not the live bug: {not_the_bug}")
            stock = None
    for label, r in (("stock", s), ("ext", e)):
        if r.first_failure:
            notes.append(f"{label}: {r.first_failure}")
    verified = ext is True and stock is not None and _word(stock) == stock_expected
    return make_row(name, "F10", "all", _word(stock), _word(ext), verified, time.perf_counter() - t0,
                    stock_expected=stock_expected, note="; ".join(notes))


def not_run_reason(policy) -> Optional[str]:
    """Why the F10 rows are "n/a" on ``policy``'s release, or None where they run (also ``selftest --list``)."""
    if policy.is_live("F10") and policy.support is releases.Support.ACTIVE:
        return None
    status = policy.fixes.get("F10")
    return (f"F10 is {getattr(status, 'value', status)!r} on SGLang {policy.version}: -ext installs no "
            "metadata-gate deadline here")


def metadata_gate_rows(deadline_s: int = DEADLINE_S, names: Optional[List[str]] = None) -> List[Dict]:
    """F10 rows for the selftest table: each case run stock and ext in this process.

    Where F10 is not live (the plugin installs no gate there) the rows are "n/a".
    ``names`` limits the rows; one not asked for is neither run nor reported.
    """
    from sglang_disagg_ext.selftest.rows import make_row

    policy = releases.current_policy()
    lost_name, landed_name = metadata_gate_row_names()
    wanted = [n for n in (lost_name, landed_name) if names is None or n in names]
    why = not_run_reason(policy)
    if why:
        return [make_row(n, "F10", "all", "n/a", "n/a", False, 0.0, why=why) for n in wanted]
    try:  # import SGLang's modules up front, so no row's seconds include them
        from sglang.srt.disaggregation import decode  # noqa: F401
        from sglang.srt.managers import schedule_batch  # noqa: F401
    except Exception:
        pass  # the rows report what is missing
    cases = (
        (lost_name, lambda ext: gate_scenario(ext, "lost", deadline_s), "fail", stock_lost_signature),
        (landed_name, lambda ext: gate_scenario(ext, "landed", deadline_s), "pass", None),
    )
    return [_row(*case) for case in cases if case[0] in wanted]
