"""F21: decode never gives a failed request's pages back while prefill may still write to them.

Narrowest boundary: SGLang's own ``DecodeTransferQueue.resolve_deferred_releases`` (0.5.21+), the
method decode's scheduler calls once per iteration to give back the pages of requests whose transfer
failed after decode published them to prefill. Driven here as the scheduler drives it, every 20 ms.
Real: the queue's ``_defer_release`` / ``resolve_deferred_releases`` / ``_do_release`` (with its
all-reduce over a one-rank gloo group in 0.5.23), the manager's drain-ack table
(``register_deferred_abort_room``, ``handle_abort_ack_message`` fed SGLang's own ``AbortAck`` frames,
``is_abort_release_safe``; on 0.5.21, whose acks carry no generation, ``note_abort_ack`` as decode's
ack listener calls it), its ``_handle_node_failure`` (what decode's heartbeat calls for a prefill
that fails its health checks), the receiver's ``_send_abort_notification`` over a real ZMQ socket to a bound "prefill
rank" socket that reads each ``ABORT`` back (SGLang's ``AbortNotification.from_zmq``; 0.5.21's four
frames by hand), and, for
``-ext``, the classes and hook that activating ``mooncake-ext`` or ``nixl-ext`` routes and installs (each
test runs on both engines' managers and receivers).

Stand-ins, for what needs a running server: the manager, receiver and queue are made without
``__init__`` (which bind sockets, start threads and an engine, read a server's config); their
attributes are set as ``__init__`` sets them on one decode rank. The queue's ``_release_request``
(stock frees the request's KV pages through the tree cache) records when it was called: that call is
the moment the pages go to the next request. The late write itself is not made: the test shows when
the pages are given back, not what a write landing after it would corrupt.

Stock (the bug): a room whose prefill stays silent is given back at the timeout ("releasing
anyway"). ``-ext``: held through 3 timeouts while the prefill is alive and silent, its ``ABORT`` sent
again each timeout period (0.5.22+: with a fresh generation), given back at the next call once the prefill acks
(0.5.22+: that generation), or once its rank socket refuses connections (the process is gone; a prefill the
heartbeat declared dead whose socket still accepts stays held). A room acked in time goes back at once
in both.
"""

from __future__ import annotations

import collections
import importlib
import logging
import threading
import time
import types

import pytest

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from sglang_disagg_ext import backend_table, releases  # noqa: E402
from sglang_disagg_ext.backends.common import held_pages  # noqa: E402

pytestmark = pytest.mark.timeout(120)

POLICY = releases.current_policy()
_F21 = POLICY.fixes.get("F21")
PATCHED = "F21" in POLICY.patched
# Sources carrying patches/<release>/'s F21 diff (`make test-patched`): the plugin installs nothing, and
# SGLang's own classes must do what -ext does on the unpatched wheel.
needs_fix = pytest.mark.skipif(
    not (POLICY.is_live("F21") or PATCHED),
    reason=f"n/a: F21 is {getattr(_F21, 'value', _F21)!r} on SGLang {POLICY.version}: the plugin installs nothing there",
)

TIMEOUT_S = 1.0  # the queue's deferred_kv_release_timeout (SGLang's default is 30 s)
# 0.5.22+ number each ABORT and its acks (a generation); 0.5.21's carry the room alone.
GENERATIONS = releases.features().deferred_release_entry == "held_since"
POLL_S = 0.02
SILENT, ACKED = 8_100_001, 8_100_002  # rooms: prefill never acks / acks at once
PREFILL_ADDR = "127.0.0.1:8998"  # the bootstrap address the receivers name (never dialled)


class PrefillRank:
    """A bound PULL socket standing where a prefill rank's bootstrap socket is: every ABORT decode
    sends it is read back with SGLang's own parser."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.aborts = []  # (room, generation)

    def drain(self):
        while not self.sock.closed and self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if GENERATIONS:
                from sglang.srt.disaggregation.common.conn import AbortNotification

                note = AbortNotification.from_zmq(frames)
                self.aborts.append((note.room, note.generation))
            else:  # 0.5.21 common/conn.py _send_abort_notification: ABORT, room, decode ip, decode port
                assert frames[0] == b"ABORT" and len(frames) == 4, frames
                self.aborts.append((int(frames[1]), None))
        return self.aborts

    def close(self):
        if not self.sock.closed:
            self.sock.close(linger=0)
            self.ctx.term()


def _one_rank_group():
    from sglang_disagg_ext.selftest.scenarios.metadata_gate import _one_rank_group as group

    return group()


def _manager(cls):
    mgr = object.__new__(cls)
    # As CommonKVManager.__init__ sets them on decode (0.5.23 common/conn.py:338-492), deferred release on.
    mgr.enable_deferred_decode_kv_release = True
    mgr._deferred_abort_ack_tracker = {}
    mgr._deferred_abort_generation = 0
    mgr.connection_lock = threading.Lock()
    mgr.connection_pool = {}
    mgr.prefill_info_table = {}
    mgr.heartbeat_failures = {}
    mgr.addr_to_rooms_tracker = collections.defaultdict(set)
    mgr.request_status = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr.local_ip = "127.0.0.1"
    mgr.rank_port = 17_001
    return mgr


def _receiver(cls, mgr, room, rank_ports):
    receiver = object.__new__(cls)
    receiver.kv_mgr = mgr
    receiver.bootstrap_room = room
    receiver.bootstrap_addr = PREFILL_ADDR
    receiver.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": port} for port in rank_ports]
    receiver.init_time = time.time()  # decode published its pages (send_metadata)
    receiver.abort_notified = False
    receiver._abort_generation = None
    receiver._owns_bootstrap_room = False  # clear() then leaves the manager's room tables alone
    receiver._lifecycle_lock = threading.Lock()
    receiver.conclude_state = None
    return receiver


def _queue(released):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    queue = object.__new__(DecodeTransferQueue)
    queue._deferred_releases = []
    queue.deferred_kv_release_timeout = TIMEOUT_S
    queue.enable_deferred_kv_release = True
    queue.enable_host_receive = False
    queue.enable_staging = False
    queue.staging_handler = None
    queue.gloo_group = _one_rank_group()
    queue.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
    queue.metadata_buffers = types.SimpleNamespace(
        bootstrap_room=torch.zeros((4, 8), dtype=torch.int64), clear_slot=lambda idx: None)
    queue.scheduler = types.SimpleNamespace(metrics_reporter=types.SimpleNamespace(enable_metrics=False))
    queue._release_request = lambda decode_req: released.setdefault(decode_req.req.bootstrap_room, time.monotonic())
    return queue


def _fail(queue, receiver_cls, mgr, room, *ranks):
    """What the queue's Failed branch does for a device destination: ABORT out (drain ack armed),
    then hold the pages (``_defer_release``)."""
    receiver = _receiver(receiver_cls, mgr, room, [rank.port for rank in ranks])
    receiver.ensure_abort_notified(force_arm=True)
    decode_req = types.SimpleNamespace(
        req=types.SimpleNamespace(bootstrap_room=room), kv_receiver=receiver, host_staged=False,
        metadata_buffer_index=queue.req_to_metadata_buffer_idx_allocator.alloc())
    queue._defer_release(decode_req)
    return receiver


def _ack(mgr, room, generation, prefill_rank=0):
    if not GENERATIONS:
        # what 0.5.21's ack listener does with [ABORT_ACK, room, prefill rank]
        mgr.note_abort_ack(room, prefill_rank)
        return
    from sglang.srt.disaggregation.common.conn import AbortAck

    assert mgr.handle_abort_ack_message(AbortAck(room, 0, generation).to_zmq())


def _generation(mgr, room):
    """The newest generation armed for ``room`` (None on 0.5.21: no generations)."""
    return mgr._deferred_abort_ack_tracker[room].generation if GENERATIONS else None


def _run(classes, rank, *, until_s, then=None):
    """Fail both rooms, drive the queue every POLL_S until ``until_s``; ``then(mgr)`` after that, and
    drive on until SILENT goes back (at most 3 s more). -> (released {room: seconds}, aborts)."""
    manager_cls, receiver_cls = classes
    released = {}
    queue = _queue(released)
    mgr = _manager(manager_cls)
    t0 = time.monotonic()
    _fail(queue, receiver_cls, mgr, SILENT, rank)
    _fail(queue, receiver_cls, mgr, ACKED, rank)
    _ack(mgr, ACKED, _generation(mgr, ACKED))
    while time.monotonic() - t0 < until_s:
        queue.resolve_deferred_releases()
        time.sleep(POLL_S)
    if then is not None:
        then(mgr)
        stop = time.monotonic() + 3.0
        while SILENT not in released and time.monotonic() < stop:
            queue.resolve_deferred_releases()
            time.sleep(POLL_S)
    time.sleep(0.1)
    return {room: at - t0 for room, at in released.items()}, rank.drain(), queue


@pytest.fixture
def rank():
    r = PrefillRank()
    yield r
    r.close()


# The hook sits on the queue and the ack table is CommonKVManager's, so every engine's -ext manager
# takes the same path; MoRI's (whose engine is a stand-in here, imported only by its own tests) too.
BACKENDS = ("mooncake", "nixl")


def _classes(package):
    record = backend_table.BY_NAME[package.__name__.rsplit(".", 1)[-1]]
    return getattr(package, record.manager_class), getattr(package, record.receiver_class)


@pytest.fixture(params=BACKENDS)
def stock_classes(request):
    package = importlib.import_module(f"sglang.srt.disaggregation.{request.param}")
    with held_pages.held_pages(enabled=False):
        yield _classes(package)


@pytest.fixture(params=BACKENDS)
def ext_classes(request, clean_activation):
    package = importlib.import_module(f"sglang.srt.disaggregation.{request.param}")
    if PATCHED:
        with held_pages.held_pages(enabled=False):
            yield _classes(package)
        return
    clean_activation.activate(f"{request.param}-ext")
    manager, receiver = _classes(package)
    # What SGLang's backend lookup reads (the package's names) once the -ext name is activated.
    assert held_pages.installed() and manager.__module__.startswith("sglang_disagg_ext.")
    yield manager, receiver


@needs_fix
def test_stock_gives_a_silent_prefills_pages_back_at_the_timeout(stock_classes, rank, caplog):
    if PATCHED:
        pytest.skip("n/a: these sources carry patches/'s F21 diff; the ext tests run against them")
    caplog.set_level(logging.WARNING)
    released, aborts, _ = _run(stock_classes, rank, until_s=3 * TIMEOUT_S)
    assert released[ACKED] < TIMEOUT_S / 2  # acked at once: back at the first call
    # The bug: no ack, prefill alive, and the pages go to the next request at the timeout.
    assert TIMEOUT_S <= released[SILENT] < TIMEOUT_S + 1.0, released
    assert f"Deferred KV release for room {SILENT} timed out" in caplog.text and "releasing anyway" in caplog.text
    assert [room for room, _ in aborts].count(SILENT) == 1  # one ABORT, never again


@needs_fix
@pytest.mark.parametrize("then", ["prefill_acks", "prefill_process_gone"])
def test_ext_keeps_a_silent_prefills_pages_until_it_acks_or_its_process_is_gone(ext_classes, rank, caplog, then):
    caplog.set_level(logging.INFO)
    generations = []

    def prefill_acks(mgr):
        # The prefill (alive, say restarted) answers the newest ABORT it was sent.
        generations.extend(g for room, g in rank.drain() if room == SILENT)
        _ack(mgr, SILENT, generations[-1])

    def prefill_process_gone(mgr):
        rank.drain()
        rank.close()  # its rank socket closed, as at the process's exit: connections refused

    hold_s = 3 * TIMEOUT_S + 0.5  # ABORTs at 0 s (stock's), ~1, ~2 and ~3 s
    released, aborts, queue = _run(ext_classes, rank, until_s=hold_s,
                                   then={"prefill_acks": prefill_acks, "prefill_process_gone": prefill_process_gone}[then])
    assert released[ACKED] < TIMEOUT_S / 2  # acked in time: untouched by the fix
    assert released[SILENT] >= hold_s, released  # held through 3 timeouts
    # then back at the next calls: at once on the ack; once gone, after the next look (one period on)
    assert released[SILENT] < hold_s + (1.0 if then == "prefill_acks" else 2 * TIMEOUT_S + 0.5), released
    assert queue._deferred_releases == []
    silent = [g for room, g in aborts if room == SILENT]
    # Stock's ABORT, then one per timeout period (at ~1, ~2, ~3 s; the third may fall past 3.5 s on a
    # loaded machine), each a fresh generation where there are some (so a late ack of an old one cannot
    # release the pages).
    assert 3 <= len(silent) <= 4, aborts
    if GENERATIONS:
        assert silent == sorted(set(silent)), aborts
    # Stock's own release path (and words) gives the pages back once the plugin says the prefill is gone.
    assert ("releasing anyway" in caplog.text) is (then == "prefill_process_gone" and not PATCHED)
    if then == "prefill_acks":
        assert generations[-1] == silent[-1]
    if PATCHED:  # SGLang's own words, patched
        assert caplog.text.count(f"Deferred KV release for room {SILENT} timed out after 1.0s") == 1
        assert "holding its pages until prefill acks or its process is gone" in caplog.text
        assert (f"Deferred KV release for room {SILENT}: every prefill rank endpoint refuses connections"
                in caplog.text) is (then == "prefill_process_gone")
        return
    assert caplog.text.count(f"keeping room {SILENT}'s pages past the 1 s deferred release timeout") == 1
    assert f"prefill {PREFILL_ADDR} has not confirmed (0 of 1 ranks)" in caplog.text
    if then == "prefill_acks":
        assert f"room {SILENT}'s pages go back after" in caplog.text
    else:
        assert f"giving back room {SILENT}'s pages after" in caplog.text and "its process is gone" in caplog.text


@needs_fix
def test_ext_gives_the_pages_back_at_the_operators_limit(ext_classes, rank, caplog, monkeypatch):
    if PATCHED:
        pytest.skip("n/a: SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S is the plugin's setting, not in patches/'s diff")
    monkeypatch.setenv("SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S", "2.5")
    released, _, queue = _run(ext_classes, rank, until_s=3 * TIMEOUT_S + 0.5)
    assert 2.5 <= released[SILENT] < 2.5 + 1.0, released
    assert queue._deferred_releases == []
    assert f"giving back room {SILENT}'s pages after" in caplog.text and "WITHOUT proof" in caplog.text


@needs_fix
def test_ext_leaves_stock_no_clock_read_of_its_own_to_release_by(ext_classes, rank, monkeypatch):
    """The hook reads the clock before stock's method reads it again: a timeout that falls between the
    two reads must not let stock give the pages back "anyway" (seen under load in CI, 1.0006 s)."""
    if PATCHED:
        pytest.skip("n/a: patches/'s F21 diff decides inside stock's method, on one clock read")
    manager_cls, receiver_cls = ext_classes
    released = {}
    queue = _queue(released)
    _fail(queue, receiver_cls, _manager(manager_cls), SILENT, rank)
    entry = queue._deferred_releases[0]
    held_since = time.monotonic() - TIMEOUT_S - 0.01  # stock's own read: 10 ms past the timeout
    # (decode_req, held_since, deadline, idx, acks); 0.5.21 (decode_req, deadline, idx, acks)
    queue._deferred_releases[0] = (entry[0],) + ((held_since,) if GENERATIONS else ()) + (held_since + TIMEOUT_S,) + entry[-2:]
    # The hook's read: 1 ms before it.
    monkeypatch.setattr(held_pages, "time", types.SimpleNamespace(monotonic=lambda: held_since + TIMEOUT_S - 0.001))
    queue.resolve_deferred_releases()
    assert released == {} and [e[0].req.bootstrap_room for e in queue._deferred_releases] == [SILENT]


@needs_fix
def test_ext_holds_for_a_prefill_the_heartbeat_declared_dead_while_its_socket_lives(ext_classes, rank):
    """Decode's heartbeat declaring a prefill dead (``_handle_node_failure``: its health checks failed)
    proves nothing about its writes: a stalled scheduler fails health checks and writes again when it
    wakes. While its rank socket still accepts connections the pages stay held."""
    released, _, queue = _run(ext_classes, rank, until_s=1.5 * TIMEOUT_S,
                              then=lambda mgr: mgr._handle_node_failure(PREFILL_ADDR))
    assert SILENT not in released and released[ACKED] < TIMEOUT_S / 2, released
    assert [e[0].req.bootstrap_room for e in queue._deferred_releases] == [SILENT]


@needs_fix
def test_ext_ignores_an_ack_of_an_older_generation(ext_classes, rank):
    """A late ack of stock's first ABORT (the prefill answering from before it was asked again) does
    not give the pages back: only the newest generation's ack does."""
    if not GENERATIONS:
        pytest.skip(f"n/a: SGLang {POLICY.version}'s ABORT acks carry no generation (any ack of the room counts)")

    def ack_the_first(mgr):
        _ack(mgr, SILENT, [g for room, g in rank.drain() if room == SILENT][0])

    released, _, queue = _run(ext_classes, rank, until_s=2 * TIMEOUT_S + 0.5, then=ack_the_first)
    assert SILENT not in released and released[ACKED] < TIMEOUT_S / 2, released
    assert [e[0].req.bootstrap_room for e in queue._deferred_releases] == [SILENT]


@needs_fix
def test_ext_keeps_the_acks_counted_before_it_asks_again(ext_classes, rank):
    """0.5.21: stock's ABORT send re-arms the room's ack table (a fresh set, for a room a later request
    reuses) and acks carry no generation. A prefill rank that acked this request's ABORT before F21 sent
    it again stays counted: the pages go back once the other rank acks, without the first acking twice."""
    if GENERATIONS:
        pytest.skip(f"n/a: SGLang {POLICY.version} counts acks per ABORT generation: each rank answers the newest")
    other = PrefillRank()
    try:
        manager_cls, receiver_cls = ext_classes
        released = {}
        queue = _queue(released)
        mgr = _manager(manager_cls)
        _fail(queue, receiver_cls, mgr, SILENT, rank, other)
        assert queue._deferred_releases[0][-1] == 2  # two prefill ranks to ack
        _ack(mgr, SILENT, None, prefill_rank=0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5 * TIMEOUT_S:  # one resend, at ~1 s
            queue.resolve_deferred_releases()
            time.sleep(POLL_S)
        assert SILENT not in released
        assert [room for room, _ in rank.drain()] == [SILENT, SILENT]  # stock's ABORT and F21's
        _ack(mgr, SILENT, None, prefill_rank=1)
        queue.resolve_deferred_releases()
        assert SILENT in released and queue._deferred_releases == []
    finally:
        other.close()
