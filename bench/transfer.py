"""Items 1 and 2: ext vs stock per-request transfer time, and state-path goodput.

:class:`TransferBench` starts one prefill and one decode ``bench.transfer_worker``
(each holding a stock and an ext Mooncake manager, see that module), keeps them
up for the whole run and drives them over a local authenticated connection.
Processes are started and killed the way the harness does it
(``harness.run._Child``: own process group, killed by group id on every exit
path). Shapes: ``bench.shapes``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener
from typing import Any, Dict, List, Optional

from bench import shapes
from bench.stats import interleaved_order, median, paired_ratios
from sglang_disagg_ext.selftest.harness.run import _Child, child_env, find_free_port
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, Scenario, StatePoolSpec, Timeouts

REPLY_TIMEOUT_S = 120.0
READ = "read"  # item 8's read floor: the ext pair, both sides reading the pages verification digests
MC_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
MC_QUEUE_DEFAULT = "16384"  # the largest this Mooncake accepts is above 16384 and below 65536


class BenchError(RuntimeError):
    pass


def bench_scenario(plan: shapes.Plan, per_component: bool) -> Scenario:
    """The pools both workers build (no requests: the parent sends page lists)."""
    pool = plan.pool_pages()
    comps = shapes.state_components(per_component)
    return Scenario(
        name="bench",
        requests=[],
        page_size=shapes.PAGE_SIZE,
        num_layers=shapes.KV_LAYERS,
        kv=KVPoolSpec(num_pages=pool["kv"], head_num=shapes.KV_HEADS, head_dim=shapes.KV_HEAD_DIM,
                      dtype=shapes.DTYPE),
        state_pools=[StatePoolSpec(kind=c.kind, num_pages=pool[c.kind], num_layers=c.layers,
                                   head_num=shapes.KV_HEADS, head_dim=c.head_dim, dtype=shapes.DTYPE)
                     for c in comps],
        aux_rows=max(plan.concurrency_sweep) + 1,
        hidden_size=64,
        # SGLang's own timeouts well above any transfer here; every wait is still bounded.
        timeouts=Timeouts(request_s=60.0, startup_s=240.0, sglang_waiting_s=60.0, sglang_bootstrap_s=60.0,
                          heartbeat_interval_s=5.0, heartbeat_max_failure=3),
    )


class TransferBench:
    """Two long-lived workers; ``sample()`` times one batch on one variant."""

    def __init__(self, plan: shapes.Plan, per_component: bool, python: Optional[str] = None,
                 max_seconds: float = 1800.0, log=print, verified: bool = False):
        self.plan = plan
        # ``verified``: the workers also hold a verified ext pair (``verify_case``).
        self.variants = ("stock", "ext") + (("verified",) if verified else ())
        self.per_component = per_component
        self.components = shapes.state_components(per_component)
        self.pool = plan.pool_pages()
        self.scn = bench_scenario(plan, per_component)
        self.python = python or sys.executable
        self.max_seconds = max_seconds
        self.log = log
        self.children: Dict[str, _Child] = {}
        self.conns: Dict[str, Any] = {}
        self.room = 10_000
        self.info: Dict[str, Any] = {}
        self.run_dir: Optional[str] = None

    # -- processes ----------------------------------------------------------------------
    def __enter__(self) -> "TransferBench":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        from sglang_disagg_ext.selftest.harness.sglang_setup import model_config_json

        self.run_dir = tempfile.mkdtemp(prefix="bench-transfer-")
        model_dir = os.path.join(self.run_dir, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(model_config_json(self.scn), f)
        scn_path = os.path.join(self.run_dir, "scenario.json")
        with open(scn_path, "w") as f:
            f.write(self.scn.to_json())
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        try:
            host, port = listener.address
            ports = ",".join(str(find_free_port()) for _ in self.variants)
            # Mooncake's TCP transport rejects a batch once a peer has more queued
            # transfers than this (default too small for a 128K-token request in
            # fragmented pages: both stock and ext then end Failed). Same for both.
            extra = {"BENCH_AUTHKEY": authkey.hex(), MC_QUEUE_ENV: os.environ.get(MC_QUEUE_ENV, MC_QUEUE_DEFAULT)}
            env = child_env(self.scn, extra)
            for role in ("prefill", "decode"):
                cmd = [
                    self.python, "-m", "bench.transfer_worker", "--role", role, "--scenario", scn_path,
                    "--ports", ports, "--variants", ",".join(self.variants), "--model-dir", model_dir,
                    "--dist-init", "file://" + os.path.join(self.run_dir, f"{role}.dist"),
                    "--control", f"{host}:{port}", "--max-seconds", str(self.max_seconds),
                ]
                self.children[role] = _Child(role, cmd, env, os.path.join(self.run_dir, f"{role}.log"),
                                             self.run_dir)
            for _ in range(2):
                conn = self._accept(listener)
                hello = conn.recv()
                self.conns[hello["hello"]] = conn
        finally:
            listener.close()
        for role in ("prefill", "decode"):
            reply = self._reply(role, self.scn.timeouts.startup_s + 30)
            if not reply.get("ok"):
                raise BenchError(f"{role} worker setup failed:\n{reply.get('error')}")
            self.info[role] = reply["ready"]

    def _accept(self, listener):
        box: Dict[str, Any] = {}

        def accept():
            try:
                box["conn"] = listener.accept()
            except OSError as e:  # listener closed after a timeout
                box["error"] = e

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline:
            t.join(0.2)
            dead = [r for r, c in self.children.items() if c.poll() is not None]
            if dead and t.is_alive():
                raise BenchError(f"worker {dead} exited before connecting:\n{self._tails()}")
        if "conn" not in box:
            raise BenchError(f"no worker connected within 120 s:\n{self._tails()}")
        return box["conn"]

    def _tails(self) -> str:
        return "\n".join(f"--- {r} log ---\n{c.tail(3000)}" for r, c in self.children.items())

    def _reply(self, role: str, timeout: float = REPLY_TIMEOUT_S) -> Dict[str, Any]:
        conn = self.conns[role]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if self.children[role].poll() is not None:
                raise BenchError(f"{role} worker exited:\n{self._tails()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{role} worker did not answer within {timeout:.0f} s:\n{self._tails()}")
        return conn.recv()

    def _call(self, role: str, msg: Dict[str, Any], timeout: float = REPLY_TIMEOUT_S) -> Dict[str, Any]:
        self.conns[role].send(msg)
        reply = self._reply(role, timeout)
        if not reply.get("ok"):
            raise BenchError(f"{role} {msg.get('op')} failed: {reply}")
        return reply

    def close(self) -> None:
        for role, conn in list(self.conns.items()):
            try:
                conn.send({"op": "quit"})
                if conn.poll(5):
                    conn.recv()
            except (OSError, EOFError):
                pass
            conn.close()
        self.conns = {}
        for c in self.children.values():
            c.kill()  # its own process group only
            c.close()
        self.children = {}
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    # -- item 1 -------------------------------------------------------------------------
    def sample(self, variant: str, case: shapes.TransferCase, pages: Dict[str, Any], verify: bool = False,
               trace: bool = False, read: bool = False) -> Dict:
        """One batch of ``case`` through ``variant``'s managers; returns prefill's timings
        (and, with ``trace``, its send path's CPU time by frame and its engine calls). ``read``
        (the ext pair, with a verified pair up): both workers also read each request's pages
        where verification digests them (item 8's read floor, ``transfer_worker.PageReader``)."""
        rooms = list(range(self.room, self.room + case.concurrency))
        self.room += case.concurrency
        common = {"variant": variant, "rooms": rooms, "aux": pages["aux"], "read": read}
        self._call("decode", {"op": "recv", "dst_kv": pages["dst_kv"], "dst_state": pages["dst_state"], **common})
        sent = self._call("prefill", {"op": "send", "src_kv": pages["src_kv"], "src_state": pages["src_state"],
                                      "trace": trace, **common})
        fin = {"op": "finish", "variant": variant, "verify": pages if verify else None}
        done = self._call("decode", fin, timeout=REPLY_TIMEOUT_S * (4 if verify else 1))
        if not sent.get("ok") or not done.get("ok"):
            raise BenchError(f"{variant} {case.name}: prefill {sent.get('statuses')} {sent.get('failures') or ''} "
                             f"decode {done.get('statuses')} {done.get('mismatches') or ''} {done.get('error') or ''}")
        # Until decode saw the last room final: decode's own check (verification) included.
        sent["end_to_end_s"] = max(done["ends"]) - sent["t0"]
        return sent

    # -- verified transfers ----------------------------------------------------
    def verify_case(self, case: shapes.TransferCase, repeats: int) -> Dict[str, Any]:
        """Verified against unverified ext transfers of ``case``: ``repeats`` interleaved
        rounds, each timed from prefill's first ``send()`` until decode saw the last room
        final (decode digests what landed before it reports Success, so its check is in the
        time); every byte checked in a warm-up of each. Each round also runs the read floor:
        the unverified pair with both sides reading the same pages once more where verification
        digests them, so verified/read says what the digest costs beyond touching its bytes."""
        pages = shapes.batch_pages(case, self.pool, self.components)
        for v in ("ext", "verified", READ):
            self.sample("ext" if v == READ else v, case, pages, verify=True, read=v == READ)
        per_req: Dict[str, List[float]] = {"ext": [], "verified": [], READ: []}
        for _, v in interleaved_order(["ext", "verified", READ], repeats):
            sample = self.sample("ext" if v == READ else v, case, pages, read=v == READ)
            per_req[v].append(sample["end_to_end_s"] / case.concurrency)
        paired = paired_ratios(per_req["verified"], per_req["ext"])
        floor = paired_ratios(per_req[READ], per_req["ext"])
        over_floor = paired_ratios(per_req["verified"], per_req[READ])
        return {
            "case": case.name,
            "tokens": case.tokens,
            "concurrency": case.concurrency,
            "with_state": case.with_state,
            "ext_s": median(per_req["ext"]),
            "verified_s": median(per_req["verified"]),
            "ratio": paired["median"],  # verified/unverified over back-to-back pairs
            "ratio_q1": paired["q1"],
            "ratio_q3": paired["q3"],
            "read_s": median(per_req[READ]),
            "read_ratio": floor["median"],  # read floor/unverified, same rounds
            "read_ratio_q1": floor["q1"],
            "read_ratio_q3": floor["q3"],
            "verified_over_read": over_floor["median"],
            "repeats": repeats,
            "samples_s": per_req,
            "timed": "prefill's first send() until decode saw the last room final, per request",
        }

    def run_case(self, case: shapes.TransferCase, repeats: int, cpu_repeats: int = 3) -> Dict[str, Any]:
        """Wall-clock pairs (untraced), then ``cpu_repeats`` traced pairs (CPU time of the
        send path, engine calls): tracing wraps methods, so it never runs in a timed pair."""
        pages = shapes.batch_pages(case, self.pool, self.components)
        for v in ("stock", "ext"):  # warm-up, and every byte of it checked
            self.sample(v, case, pages, verify=True)
        per_req: Dict[str, List[float]] = {"stock": [], "ext": []}
        lat: Dict[str, List[float]] = {"stock": [], "ext": []}
        for _, v in interleaved_order(["stock", "ext"], repeats):
            r = self.sample(v, case, pages)
            per_req[v].append(r["makespan_s"] / case.concurrency)
            lat[v].append(median(r["latencies_s"]))
        traces: Dict[str, List[Dict[str, Any]]] = {"stock": [], "ext": []}
        for _, v in interleaved_order(["stock", "ext"], cpu_repeats):
            traces[v].append(self.sample(v, case, pages, trace=True)["trace"])
        cpu = cpu_breakdown(traces, case.concurrency)
        stock, ext = median(per_req["stock"]), median(per_req["ext"])
        paired = paired_ratios(per_req["ext"], per_req["stock"])
        bytes_per_req = case.kv_pages() * shapes.kv_page_bytes()
        descs = shapes.contiguous_runs(pages["src_kv"][0], pages["dst_kv"][0]) * 2 * shapes.KV_LAYERS
        if case.with_state:
            for k, comp in enumerate(self.components):
                bytes_per_req += comp.pages_for(case.tokens) * comp.page_bytes()
                descs += shapes.contiguous_runs(pages["src_state"][0][k], pages["dst_state"][0][k]) * 2 * comp.layers
        return {
            "case": case.name,
            "tokens": case.tokens,
            "concurrency": case.concurrency,
            "with_state": case.with_state,
            "state_components": [c.kind for c in self.components] if case.with_state else [],
            "stock_s": stock,
            "ext_s": ext,
            "ratio": paired["median"],  # median of ext/stock over back-to-back pairs
            "ratio_q1": paired["q1"],
            "ratio_q3": paired["q3"],
            "stock_latency_s": median(lat["stock"]),
            "ext_latency_s": median(lat["ext"]),
            "bytes_per_request": bytes_per_req,
            "descriptors_per_request": descs,
            "repeats": repeats,
            "cpu_repeats": cpu_repeats,
            "samples_s": per_req,
            "verified": True,
            "cpu": cpu,
        }

    # -- item 2 -------------------------------------------------------------------------
    def goodput(self, state_pages: int, repeats: int) -> Dict[str, Any]:
        src, dst = [], []
        for k, comp in enumerate(self.components):
            src.append(shapes.fragmented_pages(state_pages, self.pool[comp.kind], 1000 + k))
            dst.append(shapes.fragmented_pages(state_pages, self.pool[comp.kind], 2000 + k))
        self.room += 1
        r = self._call("prefill", {"op": "goodput", "room": self.room, "src_state": src, "dst_state": dst,
                                   "repeats": repeats}, timeout=REPLY_TIMEOUT_S * 3)
        med = {k: median(v) for k, v in r["samples"].items()}
        paired = paired_ratios(r["samples"]["raw"], r["samples"]["ext"])  # ext goodput / raw goodput
        kinds = "+".join(c.kind for c in self.components)
        return {
            "case": f"{kinds} {state_pages} pages",
            "state_pages": state_pages,
            "bytes": r["bytes"],
            "ext_s": med["ext"],
            "raw_s": med["raw"],
            "raw_per_page_s": med["raw_per_page"],
            "ext_GBps": r["bytes"] / med["ext"] / 1e9,
            "raw_GBps": r["bytes"] / med["raw"] / 1e9,
            "raw_per_page_GBps": r["bytes"] / med["raw_per_page"] / 1e9,
            "ratio": paired["median"],
            "ratio_q1": paired["q1"],
            "ratio_q3": paired["q3"],
            "samples_s": r["samples"],
            "descriptors": r["descriptors"],
            "engine_calls": r["engine_calls"],
            "repeats": repeats,
        }


def cpu_breakdown(traces: Dict[str, List[Dict[str, Any]]], concurrency: int) -> Dict[str, Any]:
    """Per-request thread CPU time of the prefill send path from traced samples.

    ``traces[variant]``: the worker's ``trace`` replies (``ns`` keyed
    ``"variant|label"``; a label is ``"<fix> Class.method"`` for the plugin's
    frames, ``"stock Class.method"`` for stock's and ``"engine"`` for the
    engine's transfer calls, each exclusive of the frames it calls). Returns the
    per-sample figures in microseconds per request: ``added_us`` (the plugin's
    frames on the ext manager: what ext spends beyond stock), ``stock_us``
    (stock frames, engine excluded) and ``engine_us`` on each manager,
    ``by_fix_us`` (plugin frames grouped by fix), ``stock_by_method_us`` (stock
    frames by method, on the stock manager), and the engine-call proof: the
    normalised descriptor lists' digest, counts and bytes per variant, and
    whether every traced sample of both variants handed the engine the same.
    """
    per = 1e3 * concurrency  # ns per batch -> us per request

    def frames(trace: Dict[str, Any], variant: str) -> float:
        return sum(n for k, n in trace["frames"].items()
                   if k.split("|", 1)[0] == variant and k.split("|", 1)[1].split(" ", 1)[0] not in ("stock", "engine")
                   ) / concurrency

    def split(trace: Dict[str, Any], variant: str) -> Dict[str, Any]:
        plugin, stock, engine = 0, 0, 0
        by_fix: Dict[str, float] = {}
        by_stock: Dict[str, float] = {}
        for key, ns in trace["ns"].items():
            v, label = key.split("|", 1)
            if v != variant:
                continue
            if label == "engine":
                engine += ns
            elif label.startswith("stock "):
                stock += ns
                method = label.rsplit(".", 1)[-1]
                by_stock[method] = by_stock.get(method, 0.0) + ns / per
            else:
                plugin += ns
                fix = label.split(" ", 1)[0]
                by_fix[fix] = by_fix.get(fix, 0.0) + ns / per
        return {"plugin_us": plugin / per, "stock_us": stock / per, "engine_us": engine / per,
                "by_fix_us": by_fix, "stock_by_method_us": by_stock}

    rows = {v: [split(t, v) for t in ts] for v, ts in traces.items()}
    engine = {v: [t["engine"] for t in ts] for v, ts in traces.items()}
    digests = {e["sha256"] for es in engine.values() for e in es}
    fixes = sorted({f for r in rows["ext"] for f in r["by_fix_us"]})
    methods = sorted({m for r in rows["stock"] for m in r["stock_by_method_us"]})
    return {
        "added_us": [r["plugin_us"] for r in rows["ext"]],
        "ext_stock_us": [r["stock_us"] for r in rows["ext"]],
        "stock_stock_us": [r["stock_us"] for r in rows["stock"]],
        "ext_engine_us": [r["engine_us"] for r in rows["ext"]],
        "stock_engine_us": [r["engine_us"] for r in rows["stock"]],
        "stock_plugin_us": [r["plugin_us"] for r in rows["stock"]],  # 0: no plugin frame on stock
        "by_fix_us": {f: [r["by_fix_us"].get(f, 0.0) for r in rows["ext"]] for f in fixes},
        "stock_by_method_us": {m: [r["stock_by_method_us"].get(m, 0.0) for r in rows["stock"]] for m in methods},
        "plugin_frames_per_request": [frames(t, "ext") for t in traces["ext"]],
        "engine_calls": {v: es[0] for v, es in engine.items()},
        "engine_calls_identical": len(digests) == 1,
        "traced_labels": traces["ext"][0]["labels"],
        "decode_bounds_known": traces["ext"][0].get("decode_bounds_known"),
        "clock": "time.thread_time_ns, exclusive per frame, summed over threads",
    }
