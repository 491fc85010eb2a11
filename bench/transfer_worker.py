"""Child process of the transfer benchmark: one prefill or one decode side.

    python -m bench.transfer_worker --role prefill|decode --scenario S.json \
        --ports STOCK_PORT,EXT_PORT --model-dir D --dist-init file:///... \
        --control HOST:PORT [--max-seconds N]       (authkey in $BENCH_AUTHKEY)

Unlike the harness worker (one backend, a fixed request list, then exit), this
process stays up and serves many timed batches, so that process start-up
(about 10-20 s of imports) is paid once. It builds everything the way the
harness does, through ``harness.sglang_setup``, but twice: one **stock**
``MooncakeKVManager`` and one **ext** manager (the class ``mooncake-ext``
routes to on this release, from ``backends.mooncake.ext_classes``), each with
its own pools, ``KVArgs``, bootstrap server and port, sharing the process's
one Mooncake engine as SGLang's managers do. The parent sends commands over a
``multiprocessing.connection`` and gets a dict back for each:

* decode ``recv``: make receivers for the batch's rooms and send their metadata;
* prefill ``send``: make senders, wait until every one is WaitingForInput, then
  time from the first ``send()`` to the last sender's final state;
* decode ``finish``: wait for the receivers' final states, optionally check
  every transferred byte, clear;
* prefill ``goodput``: item 2 (see :meth:`Worker.goodput`).

A ``send`` with ``"trace": true`` also measures, per variant, the thread CPU
time of the prefill send path split into the plugin's own frames and stock's
(see :class:`CpuTracer`, :meth:`Worker._trace_on`), and records every engine
call with its descriptors normalised to (buffer, offset), so that the parent
can show stock and ext hand the engine the same lists. Tracing is installed
only for that one send: untraced (wall-clock) samples run unwrapped code.

Every wait has a deadline; the process ends with ``os._exit`` (engine threads
would keep it open) and watches its parent (``harness.worker._start_watchdog``).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import Client
from types import SimpleNamespace
from typing import Any, Dict, List

VARIANTS = ("stock", "ext")
# ``--variants stock,ext,verified``: a third pair of managers, the ext class built with
# SGLANG_DISAGG_EXT_VERIFY=1 (digests on both sides), for verified/unverified.
VERIFIED = "verified"
POLL_SLEEP_S = 0.0001
FINAL = ("Success", "Failed")
FILL_CHUNK_PAGES = 128  # pattern generation works on uint64: bound its scratch memory


# Plugin methods that are long-lived loops or start-up only: never per request.
NOT_PER_REQUEST = frozenset({"__init__", "transfer_worker", "start_prefill_thread", "start_decode_thread",
                             "_make_worker_recv", "build_receiver_registration_message",
                             "check_peer_aux_buffer_count"})
# Stock methods the plugin's frames call into, besides the ones they override.
STOCK_CALLEES = ("_send_kvcache_generic", "_transfer_data", "maybe_send_extra", "send_aux",
                 "add_transfer_request", "get_mha_kv_ptrs_with_pp", "record_failure")
ENGINE_METHODS = ("batch_transfer_sync", "transfer_sync")
ENGINE_LABEL = "engine"


class CpuTracer:
    """Exclusive thread CPU time (``time.thread_time_ns``) of labelled frames.

    A frame is one call of a wrapped function, keyed ``(variant, label)``; the
    time it spends inside other wrapped frames is charged to those, so the
    labels add up without double counting. Time outside every wrapped frame
    is not counted. Each thread keeps its own stack (the scheduler thread
    calls ``add_transfer_request``; the transfer threads the rest). CPU time,
    not wall time: a loaded machine stretches waits, not the CPU a frame uses.
    Pure Python: no SGLang import.
    """

    def __init__(self, clock=time.thread_time_ns):
        self.clock = clock
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.ns: collections.Counter = collections.Counter()
        self.frames: collections.Counter = collections.Counter()
        self._patches: List[tuple] = []

    # -- accounting ---------------------------------------------------------------------------
    def _enter(self, key) -> None:
        tls = self._tls
        stack = getattr(tls, "stack", None)
        if stack is None:
            stack = tls.stack = []
        now = self.clock()
        if stack:
            self._charge(stack[-1], now - tls.t)
        stack.append(key)
        tls.t = now

    def _exit(self) -> None:
        tls = self._tls
        now = self.clock()
        key = tls.stack.pop()
        self._charge(key, now - tls.t, frame=True)
        tls.t = now

    def _charge(self, key, ns: int, frame: bool = False) -> None:
        with self._lock:
            self.ns[key] += ns
            if frame:
                self.frames[key] += 1

    def frame(self, key, fn, *args, **kwargs):
        self._enter(key)
        try:
            return fn(*args, **kwargs)
        finally:
            self._exit()

    def take(self) -> Dict[str, Dict[str, int]]:
        """``{"ns": {"variant|label": ns}, "frames": {...}}`` so far, and reset."""
        with self._lock:
            out = {"ns": {f"{v}|{lab}": n for (v, lab), n in self.ns.items()},
                   "frames": {f"{v}|{lab}": n for (v, lab), n in self.frames.items()}}
            self.ns.clear()
            self.frames.clear()
        return out

    @classmethod
    def calibrate(cls, frames: int = 2000) -> float:
        """CPU ns one empty traced frame is charged (the tracer's own cost, included in every
        figure: the added CPU is an upper bound by about this much per plugin frame)."""

        class _Probe:
            def noop(self):
                return None

        tracer = cls()
        probe = _Probe()
        tracer.patch_method(_Probe, "noop", "probe", lambda obj: "calibration")
        try:
            for _ in range(frames):
                probe.noop()
        finally:
            tracer.unpatch()
        return tracer.take()["ns"]["calibration|probe"] / frames

    # -- wrapping -----------------------------------------------------------------------------
    def patch_method(self, owner: type, name: str, label: str, variant_of) -> None:
        """Wrap ``owner.name`` (a function in its ``__dict__``): calls on an object for which
        ``variant_of(obj)`` is not None become frames ``(variant, label)``."""
        original = owner.__dict__[name]
        tracer = self

        @functools.wraps(original)
        def traced(obj, *args, **kwargs):
            variant = variant_of(obj)
            if variant is None:
                return original(obj, *args, **kwargs)
            return tracer.frame((variant, label), original, obj, *args, **kwargs)

        setattr(owner, name, traced)
        self._patches.append(("class", owner, name, original))

    def patch_instance(self, obj, name: str, label: str, variant_now, record=None) -> None:
        """Wrap the bound method ``obj.name`` on the instance; ``record(variant, args)`` sees each call."""
        had = name in getattr(obj, "__dict__", {})
        original = getattr(obj, name)
        tracer = self

        def traced(*args, **kwargs):
            variant = variant_now()
            if record is not None:
                record(variant, args, kwargs)
            return tracer.frame((variant, label), original, *args, **kwargs)

        setattr(obj, name, traced)
        self._patches.append(("instance", obj, name, original if had else None))

    def unpatch(self) -> None:
        while self._patches:
            kind, owner, name, original = self._patches.pop()
            if kind == "instance" and original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def is_plugin_class(cls: type) -> bool:
    return (cls.__module__ or "").startswith("sglang_disagg_ext")


def fix_of(cls: type) -> str:
    """The fix id a plugin class carries (``F6``..), or ``base`` for the state class."""
    # Read from the module the worker already imported (ext_classes); never imports SGLang itself.
    backend = sys.modules.get("sglang_disagg_ext.backends.mooncake.conn")
    for fix, mixin in getattr(backend, "_FIX_MIXINS", ()):
        if cls is mixin:
            return fix
    return "base"


def traced_methods(ext_cls: type) -> Dict[str, List[tuple]]:
    """What :meth:`Worker._trace_on` wraps for ``ext_cls``: ``{"plugin": [(class, name, label)],
    "stock": [...]}``. Plugin: every per-request method a plugin class in the MRO defines over
    a stock one. Stock: every definition in a stock class of those names and of
    :data:`STOCK_CALLEES` (the stock work the plugin's frames call, engine calls inside it)."""
    mro = ext_cls.__mro__
    stock_names = set()
    for cls in mro:
        if not is_plugin_class(cls):
            stock_names.update(n for n, v in vars(cls).items() if callable(v))
    plugin, names = [], set(STOCK_CALLEES)
    for cls in mro:
        if not is_plugin_class(cls):
            continue
        for name, value in vars(cls).items():
            if isinstance(value, types.FunctionType) and name in stock_names and name not in NOT_PER_REQUEST:
                plugin.append((cls, name, f"{fix_of(cls)} {cls.__name__}.{name}"))
                names.add(name)
    stock = [(cls, name, f"stock {cls.__name__}.{name}") for cls in mro if not is_plugin_class(cls)
             for name in sorted(names) if isinstance(vars(cls).get(name), types.FunctionType)]
    return {"plugin": plugin, "stock": stock}


def buffer_bases(groups: Dict[str, Any]) -> List[tuple]:
    """Sorted ``(pointer, label)`` of every buffer in ``groups`` (name -> flat or nested pointer list)."""
    out = []
    for name, ptrs in groups.items():
        for i, p in enumerate(ptrs or []):
            if isinstance(p, (list, tuple)):
                out.extend((int(q), f"{name}{i}.{j}") for j, q in enumerate(p))
            elif p is not None:
                out.append((int(p), f"{name}{i}"))
    return sorted(out)


def normalise(addr: int, bases: List[tuple]) -> tuple:
    """``(buffer label, offset)`` of ``addr``: the nearest buffer base at or below it."""
    i = bisect.bisect_right(bases, (int(addr), "\uffff")) - 1
    if i < 0:
        return ("?", int(addr))
    return (bases[i][1], int(addr) - bases[i][0])


def calls_digest(calls: List[tuple]) -> Dict[str, Any]:
    """Counts and a digest of normalised engine calls, independent of their order across threads."""
    canon = sorted(repr(c) for c in calls)
    return {"engine_calls": len(calls), "descriptors": sum(len(c[1]) for c in calls),
            "bytes": sum(d[-1] for c in calls for d in c[1]),
            "sha256": hashlib.sha256("\n".join(canon).encode()).hexdigest()}


class Side:
    """One variant's pools, manager and classes inside this process."""

    def __init__(self, name: str):
        self.name = name
        self.pools: Dict[int, List[Any]] = {}  # pool id -> uint8 views (pages, item_bytes)
        self.mgr = None
        self.port = None
        self.addr = None
        self.keep: List[Any] = []
        self.open: Dict[int, Any] = {}  # room -> receiver (decode)
        self.reads: Dict[int, List[tuple]] = {}  # room -> pages decode reads at its Success (read floor)
        self.np_pools: Dict[int, List[Any]] = {}  # pool id -> NumPy views of ``pools`` (read floor)


class PageReader:
    """Item 8's read floor: a request's pages gathered into a 1 MiB scratch, one memcpy per
    page row, as the CPU digest gathers them before it weighs them; no placement, no digest,
    no message. Where verification digests (prefill before the transfer, decode before its
    Success), this is what touching the same bytes once more costs at the least. One per
    thread that reads."""

    def __init__(self):
        import numpy as np

        from sglang_disagg_ext.backends.common.digest_kernels import _GATHER_CHUNK

        self._np = np
        self._chunk = _GATHER_CHUNK  # the CPU digest's gather step, so both read alike
        self._scratch = np.empty(self._chunk, dtype=np.uint8)

    def read(self, jobs) -> None:
        """``jobs``: ``(pages x item_bytes`` uint8 array, page numbers``)`` pairs."""
        np = self._np
        for view, pages in jobs:
            item = view.shape[1]
            step = max(1, self._chunk // item)
            if self._scratch.size < min(len(pages), step) * item:
                self._scratch = np.empty(min(len(pages), step) * item, dtype=np.uint8)
            for lo in range(0, len(pages), step):
                part = pages[lo:lo + step]
                np.take(view, part, axis=0, out=self._scratch[:len(part) * item].reshape(len(part), item))


@contextlib.contextmanager
def _verify_env(on: bool):
    """SGLANG_DISAGG_EXT_VERIFY=1 while the verified variant's manager is built (it reads
    the switch once, in its constructor); the other variants never see it."""
    from sglang_disagg_ext.verification import VERIFY_ENV

    old = os.environ.pop(VERIFY_ENV, None)
    if on:
        os.environ[VERIFY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(VERIFY_ENV, None)
        if old is not None:
            os.environ[VERIFY_ENV] = old


def _verified_manager_class(policy) -> type:
    """The ext manager class with the verified-transfer mixin (built under the switch)."""
    from sglang_disagg_ext.backends.mooncake.conn import manager_class
    from sglang_disagg_ext.backends.mooncake.verify import MooncakeVerifiedTransferMixin

    with _verify_env(True):
        cls = manager_class(policy)
    if cls is None or not issubclass(cls, MooncakeVerifiedTransferMixin):
        raise RuntimeError(f"no verified Mooncake manager on SGLang {policy.version}: {cls}")
    return cls


class Worker:
    def __init__(self, args):
        self.args = args
        self.role = args.role
        self.variants = tuple(args.variants.split(","))
        self.sides = {v: Side(v) for v in self.variants}
        self.tracer = CpuTracer()
        self._tracing = None  # the variant a traced send runs
        self._engine_calls: Dict[str, List[tuple]] = {v: [] for v in self.variants}

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> Dict[str, Any]:
        import torch  # noqa: F401

        from bench.shapes import state_components
        from sglang_disagg_ext import releases
        from sglang_disagg_ext.backends.mooncake.conn import ext_classes
        from sglang_disagg_ext.selftest.harness import sglang_setup as ss
        from sglang_disagg_ext.selftest.harness.scenario import Scenario

        self.ss = ss
        with open(self.args.scenario) as f:
            self.scn = Scenario.from_json(f.read())
        deadline = time.monotonic() + self.scn.timeouts.startup_s
        ports = [int(p) for p in self.args.ports.split(",")]
        policy = releases.current_policy()
        dtype = ss.torch_dtype(self.scn.kv.dtype)
        for side, port in zip(self.sides.values(), ports):
            side.port = port
            side.addr = f"127.0.0.1:{port}"
            side.server_args = ss.make_server_args(
                self.args.model_dir, self.role, "mooncake", port, self.scn.page_size
            )
        first = self.sides["stock"].server_args
        ss.init_runtime(first, self.args.dist_init, self.scn.hidden_size, dtype)
        engines = ss.init_shared_engines(first)
        classes = ss.kv_classes(first)
        routed = ext_classes(policy)
        ext_manager = routed["MooncakeKVManager"]
        if issubclass(classes["manager"], ext_manager) or classes["manager"] is ext_manager:
            raise RuntimeError("the stock manager class is the plugin's: was the plugin loaded in this process?")
        self.classes = classes
        self.ext_class = ext_manager
        manager_class = {"stock": classes["manager"], "ext": ext_manager}
        # F6 before 0.5.23: the plugin's receiver publishes decode's pool sizes.
        ext_receiver = routed.get("MooncakeKVReceiver", classes["receiver"])
        self.receiver_class = {"stock": classes["receiver"], "ext": ext_receiver, VERIFIED: ext_receiver}
        if VERIFIED in self.variants:
            manager_class[VERIFIED] = _verified_manager_class(policy)
        self.KVPoll = ss.kvpoll()
        self.per_component = not ss.is_flat()
        kinds = [c.kind for c in state_components(self.per_component)]
        if [p.kind for p in self.scn.state_pools] != kinds:
            raise RuntimeError(f"scenario state pools {[p.kind for p in self.scn.state_pools]} != {kinds}")

        for side in self.sides.values():
            components = self._build_pools(side, dtype)
            if self.role == "prefill":
                side.bootstrap = classes["bootstrap_server"](host="127.0.0.1", port=side.port)
                _wait_port(side.port, deadline)
            kv_args = classes["kvargs"]()
            ss.fill_kv_args(kv_args, self.role, side.server_args, side.kv_pool, side.meta, components,
                            self.scn.num_layers, self.scn.kv.head_num)
            with _bootstrap_port_of(side.port), _verify_env(side.name == VERIFIED):
                side.mgr = ss.make_manager(manager_class[side.name], kv_args, self.role, side.server_args)
        if VERIFIED in self.variants:
            self._read_floor(self.sides["ext"])
        if self.role == "decode":
            for side in self.sides.values():
                while not ss.try_ensure_prefill_info(side.mgr, side.addr):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"prefill never registered at {side.addr}")
                    time.sleep(0.1)
        return {
            "sglang": ss.sglang_version(),
            "layout": ss.state_layout().value,
            "engines": engines,
            "managers": {v: ss.class_name(s.mgr) for v, s in self.sides.items()},
            "pid": os.getpid(),
            "tracer_ns_per_frame": CpuTracer.calibrate(),
        }

    def _build_pools(self, side: Side, dtype):
        import torch

        from sglang_disagg_ext.selftest.harness import patterns
        from sglang_disagg_ext.selftest.harness.scenario import AUX_POOL_ID, KV_POOL_ID, STATE_POOL_BASE

        ss, scn = self.ss, self.scn
        side.kv_pool = ss.make_mha_pool(scn.kv.num_pages, scn.page_size, dtype, scn.kv.head_num,
                                        scn.kv.head_dim, scn.num_layers)
        side.pools[KV_POOL_ID] = ss.mha_pool_tensors(side.kv_pool)
        side.meta = ss.make_metadata_buffers(scn.aux_rows, scn.hidden_size, dtype)
        ptrs, _, _ = side.meta.get_buf_infos()
        side.pools[AUX_POOL_ID] = ss.metadata_tensors(side.meta, ptrs)
        components = []
        for c, spec in enumerate(scn.state_pools):
            pool = ss.make_mha_pool(spec.num_pages, scn.page_size, ss.torch_dtype(spec.dtype), spec.head_num,
                                    spec.head_dim, spec.num_layers)
            side.keep.append(pool)
            side.pools[STATE_POOL_BASE + c] = ss.mha_pool_tensors(pool)
            ptrs, lens, items = pool.get_contiguous_buf_infos()
            components.append(ss.StateComponent(spec.kind, ptrs, lens, items))
        # uint8 page views; prefill holds the harness's byte patterns, decode a sentinel.
        pages = {KV_POOL_ID: scn.kv.num_pages, AUX_POOL_ID: scn.aux_rows}
        pages.update({STATE_POOL_BASE + c: spec.num_pages for c, spec in enumerate(scn.state_pools)})
        for pid, tensors in side.pools.items():
            views = []
            for b, t in enumerate(tensors):
                v = t.view(torch.uint8).reshape(pages[pid], -1)  # SGLang's page items (tokens x row)
                if self.role == "prefill":
                    for lo in range(0, v.shape[0], FILL_CHUNK_PAGES):
                        hi = min(v.shape[0], lo + FILL_CHUNK_PAGES)
                        v[lo:hi].copy_(torch.from_numpy(patterns._pattern(pid, b, range(lo, hi), v.shape[1])))
                else:
                    v.fill_(patterns.SENTINEL)
                views.append(v)
            side.pools[pid] = views
        return components

    def _read_floor(self, side: Side) -> None:
        """Prepare ``side`` (the unverified ext pair) for item 8's read floor: NumPy views of its
        pools, and on decode an ``update_status`` that reads a room's pages (listed by ``recv``)
        before stock's Success, on the status thread, where verification checks them. ``recv``
        puts it on the manager for a read-floor batch only and ``finish`` takes it off, so the
        ext pair's other samples run the class's own method."""
        self.reader = PageReader()  # prefill: the main thread's; decode: the status thread's
        side.np_pools = {pid: [v.numpy() for v in views] for pid, views in side.pools.items()}
        if self.role != "decode":
            return
        stock_update, success, reader = side.mgr.update_status, int(self.KVPoll.Success), self.reader

        def update_status(bootstrap_room, status):
            jobs = side.reads.pop(bootstrap_room, None) if int(status) == success else None
            if jobs:
                reader.read(jobs)
            return stock_update(bootstrap_room, status)

        self._reading_update_status = update_status

    def _read_jobs(self, side: Side, kv_pages, aux_row: int, state_lists) -> List[tuple]:
        """The pages verification digests for one request: its KV pages of every KV buffer, its
        metadata row of every aux buffer, its pages of every state buffer of each component."""
        import numpy as np

        from sglang_disagg_ext.selftest.harness.scenario import AUX_POOL_ID, KV_POOL_ID, STATE_POOL_BASE

        kv = np.asarray(kv_pages, dtype=np.int64)
        jobs = [(v, kv) for v in side.np_pools[KV_POOL_ID]]
        jobs += [(v, np.array([aux_row], dtype=np.int64)) for v in side.np_pools[AUX_POOL_ID]]
        for c, pages in enumerate(state_lists or []):
            if pages:
                jobs += [(v, np.asarray(pages, dtype=np.int64)) for v in side.np_pools[STATE_POOL_BASE + c]]
        return jobs

    # -- helpers ----------------------------------------------------------------------------
    def _state(self, lists):
        kinds = [p.kind for p in self.scn.state_pools]
        if not lists:  # KV only
            return self.ss.state_payload([], [])
        return self.ss.state_payload(kinds, lists)

    def _poll_all(self, objs: Dict[int, Any], targets, deadline: float) -> Dict[int, Any]:
        """Poll until each object's state is in ``targets``; returns room -> (state, time)."""
        done: Dict[int, Any] = {}
        name = self.ss.poll_name
        while len(done) < len(objs):
            for room, obj in objs.items():
                if room not in done:
                    state = name(obj.poll())
                    if state in targets:
                        done[room] = (state, time.perf_counter())
            if len(done) < len(objs):
                if time.monotonic() > deadline:
                    for room, obj in objs.items():
                        done.setdefault(room, (name(obj.poll()), time.perf_counter()))
                    break
                time.sleep(POLL_SLEEP_S)
        return done

    # -- commands ---------------------------------------------------------------------------
    def recv(self, msg) -> Dict[str, Any]:
        import numpy as np

        side = self.sides[msg["variant"]]
        deadline = time.monotonic() + self.scn.timeouts.request_s
        receivers = {}
        for room in msg["rooms"]:
            r = self.ss.make_receiver(self.receiver_class[msg["variant"]], side.mgr, side.addr, room)
            r.init(0)
            receivers[room] = r
        states = self._poll_all(receivers, ("WaitingForInput",) + FINAL, deadline)
        bad = {r: s for r, (s, _) in states.items() if s != "WaitingForInput"}
        if bad:
            return {"ok": False, "error": f"receivers not waiting for input: {bad}"}
        if msg.get("read"):
            side.mgr.update_status = self._reading_update_status  # until finish
        for i, (room, r) in enumerate(receivers.items()):
            if msg.get("read"):
                side.reads[room] = self._read_jobs(side, msg["dst_kv"][i], msg["aux"][i], msg["dst_state"][i])
            r.send_metadata(np.asarray(msg["dst_kv"][i], dtype=np.int32), msg["aux"][i],
                            self._state(msg["dst_state"][i]))
        side.open = receivers
        return {"ok": True}

    def send(self, msg) -> Dict[str, Any]:
        import numpy as np

        side = self.sides[msg["variant"]]
        deadline = time.monotonic() + self.scn.timeouts.request_s
        senders = {room: self.ss.make_sender(self.classes["sender"], side.mgr, side.addr, room)
                   for room in msg["rooms"]}
        states = self._poll_all(senders, ("WaitingForInput",) + FINAL, deadline)
        bad = {r: s for r, (s, _) in states.items() if s != "WaitingForInput"}
        if bad:
            return {"ok": False, "error": f"senders not waiting for input: {bad}"}
        pages = [np.asarray(p, dtype=np.int32) for p in msg["src_kv"]]
        state = [self._state(s) for s in msg["src_state"]]
        for i, s in enumerate(senders.values()):
            s.init(len(pages[i]), msg["aux"][i])
        reads = [self._read_jobs(side, msg["src_kv"][i], msg["aux"][i], msg["src_state"][i])
                 for i in range(len(senders))] if msg.get("read") else None
        if msg.get("trace"):
            self._trace_on(msg["variant"])
        try:
            t0 = time.perf_counter()
            for i, s in enumerate(senders.values()):
                if reads:
                    self.reader.read(reads[i])  # where the verifying prefill digests, before the transfer
                s.send(pages[i], state_indices=state[i])
            done = self._poll_all(senders, FINAL, deadline + self.scn.timeouts.request_s)
        finally:
            traced = self._trace_off() if msg.get("trace") else None
        ends = [t for _, t in done.values()]
        statuses = sorted({s for s, _ in done.values()})
        failures = {room: self.ss.failure_reason(side.mgr, room) for room, (st, _) in done.items() if st != "Success"}
        for s in senders.values():
            s.clear()  # as the prefill scheduler does after a final state
        return {
            "ok": statuses == ["Success"],
            "statuses": statuses,
            "failures": failures,
            "t0": t0,  # perf_counter: CLOCK_MONOTONIC, the same clock in the decode worker
            "makespan_s": max(ends) - t0,
            "latencies_s": [t - t0 for t in ends],
            "trace": traced,
        }

    # -- CPU tracing of the send path ---------------------------------------------------------
    def _trace_on(self, variant: str) -> None:
        """Wrap the plugin's per-request methods, the stock methods they (and stock's own send
        path) run, and the engine's transfer calls, for the managers of this process."""
        owners = {id(s.mgr): s.name for s in self.sides.values()}

        def variant_of(obj):
            return owners.get(id(obj))

        methods = traced_methods(self.ext_class)
        self.tracer.take()
        self._tracing = variant
        self._engine_calls = {v: [] for v in self.variants}
        try:
            for cls, name, label in methods["plugin"] + methods["stock"]:
                self.tracer.patch_method(cls, name, label, variant_of)
            engines = {id(s.mgr.engine): s.mgr.engine for s in self.sides.values()}
            for engine in engines.values():
                for name in ENGINE_METHODS:
                    if callable(getattr(engine, name, None)):
                        self.tracer.patch_instance(engine, name, ENGINE_LABEL, lambda: self._tracing,
                                                   functools.partial(self._record_engine_call, name))
        except BaseException:
            self.tracer.unpatch()
            raise
        self._traced_labels = {"plugin": [lab for _, _, lab in methods["plugin"]],
                               "stock": [lab for _, _, lab in methods["stock"]]}

    def _record_engine_call(self, name: str, variant: str, args, kwargs) -> None:
        if variant is None:
            return
        session, *rest = list(args) + list(kwargs.values())
        if name == "batch_transfer_sync":
            srcs, dsts, lens = (list(x) for x in rest[:3])
        else:
            srcs, dsts, lens = [rest[0]], [rest[1]], [rest[2]]
        self._engine_calls[variant].append((str(session), srcs, dsts, lens))

    def _trace_off(self) -> Dict[str, Any]:
        self.tracer.unpatch()
        variant, self._tracing = self._tracing, None
        out = self.tracer.take()
        mgr = self.sides[variant].mgr
        a = mgr.kv_args
        src = buffer_bases({"kv": a.kv_data_ptrs, "aux": a.aux_data_ptrs,
                            "state": getattr(a, "state_data_ptrs", None) or []})
        norm = []
        for session, srcs, dsts, lens in self._engine_calls[variant]:
            info = _decode_info(mgr, session)
            dst = buffer_bases({"kv": getattr(info, "dst_kv_ptrs", None), "aux": getattr(info, "dst_aux_ptrs", None),
                                "state": getattr(info, "dst_state_data_ptrs", None) or []})
            norm.append((session, tuple(normalise(s, src) + normalise(d, dst) + (int(n),)
                                        for s, d, n in zip(srcs, dsts, lens))))
        out["engine"] = calls_digest(norm)
        out["labels"] = self._traced_labels
        # F6 checks a room only where decode published its pool sizes: say whether it did.
        bounds = getattr(mgr, "_peer_bounds", None)
        out["decode_bounds_known"] = bool(bounds) if bounds is not None else None
        return out

    def finish(self, msg) -> Dict[str, Any]:
        side = self.sides[msg["variant"]]
        deadline = time.monotonic() + self.scn.timeouts.request_s
        done = self._poll_all(side.open, FINAL, deadline)
        statuses = sorted({s for s, _ in done.values()})
        mismatches = self._verify(side, msg["verify"]) if msg.get("verify") else None
        # A read-floor room whose pages decode never read did not measure the floor.
        unread = sorted(room for room in side.open if side.reads.pop(room, None) is not None)
        side.mgr.__dict__.pop("update_status", None)  # the class's own again (a read-floor batch set it)
        for r in side.open.values():
            r.clear()
        side.open = {}
        return {"ok": statuses == ["Success"] and not mismatches and not unread, "statuses": statuses,
                "mismatches": mismatches, "error": f"read floor: decode never read rooms {unread}" if unread else None,
                "ends": [t for _, t in done.values()]}  # when decode saw each room final (perf_counter)

    def _verify(self, side: Side, pages) -> List[str]:
        """Every transferred page equals the prefill pattern of its source page."""
        import numpy as np

        from sglang_disagg_ext.selftest.harness import patterns
        from sglang_disagg_ext.selftest.harness.scenario import KV_POOL_ID, STATE_POOL_BASE

        out = []
        pairs = {KV_POOL_ID: (sum(pages["src_kv"], []), sum(pages["dst_kv"], []))}
        for c in range(len(self.scn.state_pools)):
            src = sum((req[c] for req in pages["src_state"] if req), [])
            dst = sum((req[c] for req in pages["dst_state"] if req), [])
            if src:
                pairs[STATE_POOL_BASE + c] = (src, dst)
        for pid, (src, dst) in pairs.items():
            for b, view in enumerate(side.pools[pid]):
                for lo in range(0, len(src), FILL_CHUNK_PAGES):
                    s = src[lo:lo + FILL_CHUNK_PAGES]
                    d = dst[lo:lo + FILL_CHUNK_PAGES]
                    want = patterns._pattern(pid, b, s, view.shape[1])
                    got = view.numpy()[np.asarray(d)]
                    bad = np.nonzero((want != got).any(axis=1))[0]
                    if bad.size:
                        out.append(f"pool {pid} buffer {b}: {bad.size} wrong pages, first decode page {d[bad[0]]}")
                        break
        return out

    def goodput(self, msg) -> Dict[str, Any]:
        """Item 2: the ext manager's state path against the raw engine.

        The ext manager's ``maybe_send_extra`` (the whole state path: planning,
        page-run coalescing, one batch write per component) is called directly
        for a registered decode session, as SGLang's transfer worker calls it
        on the last chunk. Once, untimed, the (src, dst, len) lists it hands to
        ``engine.batch_transfer_sync`` are recorded; the raw side then calls
        Mooncake's ``TransferEngine.batch_transfer_sync_write`` with exactly
        those lists, and a third side with the same bytes one descriptor per
        page (no coalescing). Interleaved, medians.
        """
        from bench.stats import run_interleaved

        side = self.sides["ext"]
        mgr = side.mgr
        if not mgr.decode_kv_args_table:
            return {"ok": False, "error": "no decode session registered yet (run a transfer first)"}
        session = next(iter(mgr.decode_kv_args_table))
        info = mgr.decode_kv_args_table[session]
        req = SimpleNamespace(room=msg["room"], mooncake_session_id=session, dst_state_indices=None)
        src_lists, dst_lists = msg["src_state"], msg["dst_state"]
        executor = mgr.executors[0]
        if self.per_component:
            req.dst_state_indices = [list(d) for d in dst_lists]

            def ext_path() -> int:
                return mgr.maybe_send_extra(req, [list(s) for s in src_lists], executor, info)
        else:
            req.dst_state_indices = list(dst_lists[0])

            def ext_path() -> int:
                return mgr.maybe_send_extra(req, list(src_lists[0]), info.dst_state_data_ptrs, executor, info)

        wrapper = mgr.engine
        calls: List[tuple] = []
        original = wrapper.batch_transfer_sync

        def recording(session_id, srcs, dsts, lens):
            calls.append((list(srcs), list(dsts), list(lens)))
            return original(session_id, srcs, dsts, lens)

        wrapper.batch_transfer_sync = recording
        try:
            rc = ext_path()
        finally:
            del wrapper.batch_transfer_sync  # back to the class's method
        if rc != 0 or not calls:
            return {"ok": False, "error": f"ext state path returned {rc} with {len(calls)} engine calls"}
        per_page = [_per_page(c, self._state_buffers(mgr)) for c in calls]
        raw_engine = wrapper.engine  # the mooncake TransferEngine the wrapper calls

        def timed(fn):
            def run() -> float:
                t0 = time.perf_counter()
                rc = fn()
                dt = time.perf_counter() - t0
                if rc != 0:
                    raise RuntimeError(f"transfer returned {rc}")
                return dt
            return run

        def raw(lists):
            def go() -> int:
                rc = 0
                for s, d, n in lists:
                    rc = raw_engine.batch_transfer_sync_write(session, s, d, n) or rc
                return rc
            return go

        samples = run_interleaved(
            {"ext": timed(ext_path), "raw": timed(raw(calls)), "raw_per_page": timed(raw(per_page))},
            repeats=msg["repeats"],
        )
        return {
            "ok": True,
            "samples": samples,
            "bytes": sum(sum(c[2]) for c in calls),
            "descriptors": {"ext": sum(len(c[2]) for c in calls), "raw": sum(len(c[2]) for c in calls),
                            "raw_per_page": sum(len(c[2]) for c in per_page)},
            "engine_calls": len(calls),
        }

    @staticmethod
    def _state_buffers(mgr) -> List[tuple]:
        """(pointer, length, page bytes) of every local state buffer, by pointer."""
        a = mgr.kv_args

        def flat(x):
            out = []
            for v in x:
                out.extend(v if isinstance(v, (list, tuple)) else [v])
            return [int(v) for v in out]

        return sorted(zip(flat(a.state_data_ptrs), flat(a.state_data_lens), flat(a.state_item_lens)))

    # -- loop -------------------------------------------------------------------------------
    def serve(self, conn) -> None:
        ops = {"recv": self.recv, "send": self.send, "finish": self.finish, "goodput": self.goodput}
        while True:
            msg = conn.recv()
            op = msg.get("op")
            if op == "quit":
                conn.send({"ok": True})
                return
            try:
                reply = ops[op](msg)
            except Exception:
                reply = {"ok": False, "error": traceback.format_exc(limit=8)[-3000:]}
            conn.send(reply)


def _bootstrap_port_of(port: int):
    """While building one side's manager, SGLang's published bootstrap port is that side's.

    0.5.23 reads the prefill bootstrap port from the process's runtime context
    (``get_disagg().disaggregation_bootstrap_port``), not from the server args the
    manager is given: without this both managers would register at the first
    side's bootstrap server. Older releases read the server args: nothing to do."""
    import contextlib

    try:
        from sglang.srt.runtime_context import get_disagg

        bag = get_disagg()
        bag.disaggregation_bootstrap_port  # noqa: B018 - published on this release?
    except (ImportError, AttributeError, ValueError):
        return contextlib.nullcontext()
    return bag.override(disaggregation_bootstrap_port=port)


def _decode_info(mgr, session: str):
    """Decode's registration (``KVArgsRegisterInfo``) for ``session`` on ``mgr``, or None."""
    return (getattr(mgr, "decode_kv_args_table", None) or {}).get(session)


def _per_page(call, buffers: List[tuple]):
    """The same bytes as ``call``'s descriptors, one descriptor per page.

    ``buffers``: (base pointer, length, page bytes) of every local state
    buffer; each descriptor is cut at the page size of the buffer it reads."""
    import bisect

    bases = [b[0] for b in buffers]
    srcs, dsts, lens = [], [], []
    for s, d, n in zip(*call):
        i = bisect.bisect_right(bases, s) - 1
        if i < 0 or s + n > buffers[i][0] + buffers[i][1]:
            raise RuntimeError(f"descriptor 0x{s:x}+{n} is not inside one registered state buffer")
        item = buffers[i][2]
        for k in range(n // item):
            srcs.append(s + k * item)
            dsts.append(d + k * item)
            lens.append(item)
    return srcs, dsts, lens


def _wait_port(port: int, deadline: float) -> None:
    import socket

    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bootstrap server did not listen on port {port}")
            time.sleep(0.05)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--scenario", required=True)
    p.add_argument("--ports", required=True, help="bootstrap ports, one per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="stock,ext[,verified]")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dist-init", required=True)
    p.add_argument("--control", required=True, help="HOST:PORT of the parent's listener")
    p.add_argument("--max-seconds", type=float, default=None)
    args = p.parse_args(argv)
    from sglang_disagg_ext.selftest.harness.worker import _start_watchdog

    _start_watchdog(args.max_seconds)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = args.control.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["BENCH_AUTHKEY"]))
    conn.send({"hello": args.role})
    worker = Worker(args)
    try:
        info = worker.setup()
        conn.send({"ok": True, "ready": info})
        worker.serve(conn)
    except BaseException:
        err = traceback.format_exc()[-4000:]
        print(err, file=sys.stderr, flush=True)
        try:
            conn.send({"ok": False, "error": err})
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
