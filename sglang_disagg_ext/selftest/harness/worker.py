"""Child-process entry of the transfer harness: one prefill or one decode side.

    python -m sglang_disagg_ext.selftest.harness.worker --role prefill|decode \
        --scenario S.json --backend NAME --bootstrap-port P --model-dir D \
        --dist-init file:///... --result R.json --done-file F [--load-plugin auto|yes|no]

Builds the objects SGLang's scheduler builds (see ``sglang_setup``), runs the
scenario's requests one after another through the backend's real manager,
sender/receiver and the real bootstrap server, and writes a JSON result after
each request (atomically), so a parent that has to kill the process still gets
what was done. Decode verifies every byte it owns after each request with
``patterns``. Every wait has a deadline. The process ends with ``os._exit`` so
that engine threads cannot hold it open.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

T_START = time.monotonic()

POLL_SLEEP_S = 0.002
POLL_RAISED = "raised"  # wave runs: a poll() that raised (worker._poll_one)
FINAL = ("Success", "Failed")
PEER_GRACE_S = 3.0  # a live prefill reaches its final state well inside this after decode
DECODE_HOOK_ENV = "SGLANG_HARNESS_DECODE_HOOK"
PREFILL_HOOK_ENV = "SGLANG_HARNESS_PREFILL_HOOK"
DECODE_MANAGER_HOOK_ENV = "SGLANG_HARNESS_DECODE_MANAGER_HOOK"
# Comma-separated logger names (e.g. sglang.srt.disaggregation.nixl.conn) to
# log at DEBUG in the children, for chasing a stuck bootstrap.
DEBUG_LOGGERS_ENV = "SGLANG_HARNESS_DEBUG_LOGGERS"
MAX_LOG_LINES_PER_REQUEST = 30
MAX_LOG_LINE = 600


def _now() -> float:
    return time.monotonic() - T_START



def _plugin_metrics_text() -> str:
    """This process's ``sglang_disagg_ext_*`` metrics in Prometheus text format ("" if none were made).

    Read only when the plugin's metrics module was used here (importing
    ``prometheus_client`` otherwise would be the harness's doing, not SGLang's).
    """
    if "sglang_disagg_ext.metrics" not in sys.modules:
        return ""
    from prometheus_client import REGISTRY, generate_latest

    text = generate_latest(REGISTRY).decode()
    return "\n".join(line for line in text.splitlines() if "sglang_disagg_ext_" in line)

class _LogCapture(logging.Handler):
    """Keeps WARNING+ records (SGLang's own, e.g. state-index trims) with times."""

    def __init__(self, level=logging.WARNING):
        super().__init__(level=level)
        self.lines: List[tuple] = []
        self._mu = threading.Lock()

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:  # pragma: no cover
            msg = str(record.msg)
        with self._mu:
            self.lines.append((_now(), f"{record.levelname} {record.name}: {msg}"[:MAX_LOG_LINE]))

    def since(self, t0: float) -> List[str]:
        with self._mu:
            return [m for t, m in self.lines if t >= t0][:MAX_LOG_LINES_PER_REQUEST]


class _ThreadErrors:
    """Exceptions that kill SGLang's background threads (e.g. the transfer worker)."""

    def __init__(self):
        self.items: List[tuple] = []
        self._prev = threading.excepthook
        threading.excepthook = self._hook

    def _hook(self, args):
        name = getattr(args.thread, "name", "?")
        self.items.append((_now(), f"thread {name}: {args.exc_type.__name__}: {args.exc_value}"[:MAX_LOG_LINE]))
        self._prev(args)

    def since(self, t0: float) -> List[str]:
        return [m for t, m in self.items if t >= t0]


class Worker:
    def __init__(self, args):
        self.args = args
        self.role = args.role
        self.result: Dict[str, Any] = {
            "role": self.role,
            "pid": os.getpid(),
            "backend_requested": args.backend,
            "requests": [],
            "timings": {},
            "error": None,
            "done": False,
        }
        self.logs = _LogCapture()
        self.plugin_log = _LogCapture(level=logging.INFO)
        self.thread_errors = _ThreadErrors()

    # -- result file ---------------------------------------------------------
    def write_result(self) -> None:
        if getattr(self, "dropped", None) is not None:
            self.result["dropped_writes"] = self.dropped.report()
        if getattr(self, "prefill_hook_state", None) is not None:
            self.result["prefill_hook_report"] = self.prefill_hook_state.report()
        self.result["thread_errors"] = [m for _, m in self.thread_errors.items][:20]
        self.result["plugin_log"] = [m for _, m in self.plugin_log.lines if m.startswith("INFO ")][:20]
        self.result["plugin_metrics"] = _plugin_metrics_text()
        tmp = self.args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.args.result)

    def mark(self, key: str) -> None:
        self.result["timings"][key] = round(_now(), 3)
        print(f"[harness {self.role} {_now():7.2f}s] {key}", file=sys.stderr, flush=True)

    # -- setup ---------------------------------------------------------------
    def setup(self) -> None:
        from sglang_disagg_ext.selftest.harness.scenario import Scenario

        with open(self.args.scenario) as f:
            self.scn = Scenario.from_json(f.read())
        self.scn.validate()
        deadline = T_START + self.scn.timeouts.startup_s

        import torch

        from sglang_disagg_ext.selftest.harness import sglang_setup as ss
        from sglang_disagg_ext.selftest.harness.transport import TransferOptions

        self.ss = ss
        self.mark("imported_torch")
        self.opts = TransferOptions(self.args.protocol, self.args.device, self.args.ib_device).validated()
        self.result["transfer_options"] = dataclasses.asdict(self.opts)
        if self.opts.device_type == "cuda":
            _check_cuda(torch, self.opts.device)
        self.result["plugin_loader"] = ss.load_plugin(self.args.load_plugin, self.args.backend)
        self.result["sglang_version"] = ss.sglang_version()
        from sglang_disagg_ext.selftest.harness import nixl_shim

        if nixl_shim.wanted():
            if self.opts.device_type == "cpu":
                self.result["shim"] = nixl_shim.install()
            else:  # device pools are the VRAM stock NIXL registers them as
                self.result["shim"] = f"nixl host-memory shim not installed: pools are on {self.opts.device}"
        self.tp_rank = self.args.tp_rank
        self.tp_size = self.scn.prefill_tp if self.role == "prefill" else self.scn.decode_tp
        # This side's --page-size (Scenario.decode_page_size: a decode started with another).
        self.page_size = (self.scn.decode_page_size if self.role == "decode" and self.scn.decode_page_size
                          else self.scn.page_size)
        self.result["tp"] = [self.tp_rank, self.tp_size]
        try:
            sa = ss.make_server_args(
                self.args.model_dir, self.role, self.args.backend, self.args.bootstrap_port, self.page_size,
                tp_size=self.tp_size, device=self.opts.device, ib_device=self.opts.ib_device,
            )
        except Exception as exc:
            if not self.opts.ib_device:
                raise
            # SGLang checks --disaggregation-ib-device against sysfs in ServerArgs.
            from sglang_disagg_ext.selftest.harness.transport import rdma_init_failure

            why = f"SGLang's ServerArgs refused the IB device: {type(exc).__name__}: {exc}"
            raise RuntimeError(rdma_init_failure("ServerArgs", self.opts.ib_device, why)) from exc
        self.server_args = sa
        self.result["backend_effective"] = sa.disaggregation_transfer_backend
        self.mark("server_args")
        dtype = ss.torch_dtype(self.scn.kv.dtype)
        gpu_id = self.opts.gpu_index if self.opts.device_type == "cuda" else None
        ss.init_runtime(
            sa, self.args.dist_init, self.scn.hidden_size, dtype, rank=self.tp_rank, world_size=self.tp_size,
            gpu_id=gpu_id,
        )
        self.result["shared_engines"] = ss.init_shared_engines(sa, gpu_id=self.opts.gpu_index, protocol=self.opts.protocol)
        if "mooncake-transfer-engine" in self.result["shared_engines"]:
            self.result["engine"] = ss.mooncake_engine_report(sa, self.opts.protocol)
        elif sa.disaggregation_transfer_backend == "nixl":
            from sglang_disagg_ext.selftest.harness import nixl_pacing

            # Before the manager makes its agent: NIXL's progress thread
            # otherwise spins a whole core per process (nixl_pacing).
            delay_us = nixl_pacing.delay_from_env()
            not_paced = nixl_pacing.pace_progress_thread(delay_us)
            # UCX picks its transport from UCX_TLS (transport.ucx_tls); this is
            # the configuration the agent is created under.
            self.result["engine"] = {
                "engine": "nixl",
                "ucx_tls": os.environ.get("UCX_TLS"),
                "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
                "progress_thread_delay_us": 0 if not_paced else delay_us,
            }
            if not_paced:
                self.result["engine"]["progress_thread_not_paced"] = not_paced
        else:
            self.result["engine"] = {"engine": sa.disaggregation_transfer_backend}
        self.mark("runtime")

        self.classes = ss.kv_classes(sa)
        self.result["classes"] = {
            k: ss.class_name(v) for k, v in self.classes.items() if isinstance(v, type) and k != "backend"
        }
        self._build_pools(dtype)
        self.mark("pools")

        self.bootstrap_addr = f"127.0.0.1:{self.args.bootstrap_port}"
        if self.role == "prefill" and self.tp_rank == 0:
            # The bootstrap server must listen before the prefill manager
            # registers (older releases try once).
            server_cls = self.classes["bootstrap_server"]
            self.bootstrap_server = server_cls(host=sa.host, port=sa.disaggregation_bootstrap_port)
            _wait_port("127.0.0.1", self.args.bootstrap_port, deadline)
            self.mark("bootstrap_server")
        elif self.role == "prefill":  # other prefill ranks: rank 0's server must listen first
            _wait_port("127.0.0.1", self.args.bootstrap_port, deadline)

        kv_args = self.classes["kvargs"]()
        self.result["kv_args"] = ss.fill_kv_args(
            kv_args, self.role, sa, self.kv_pool, self.meta, self.state_components, self.scn.num_layers,
            self.scn.kv.head_num, engine_rank=self.tp_rank, gpu_id=self.opts.gpu_index,
        )
        try:
            self.mgr = ss.make_manager(self.classes["manager"], kv_args, self.role, sa)
        except Exception as exc:
            if self.opts.protocol != "rdma" or sa.disaggregation_transfer_backend != "nixl":
                raise
            from sglang_disagg_ext.selftest.harness.transport import rdma_init_failure

            why = f"UCX_TLS={os.environ.get('UCX_TLS')}: {type(exc).__name__}: {exc}"
            raise RuntimeError(rdma_init_failure("NIXL UCX backend", self.opts.ib_device, why)) from exc
        self.result["manager_class"] = ss.class_name(self.mgr)
        self.result["sglang_ranks"] = ss.sglang_ranks(self.mgr)
        if self.role == "prefill":
            self._run_prefill_hook()
            self._watch_decode_aborts()
            if self.scn.dropped_kv_pages:
                from sglang_disagg_ext.selftest.harness import faults

                self.dropped = faults.drop_engine_writes(self.mgr, self.scn.dropped_kv_pages)
            if self.scn.fail_every_nth_post:
                from sglang_disagg_ext.selftest.harness import faults

                self.dropped = faults.fail_nixl_posts(self.mgr, self.scn.fail_every_nth_post,
                                                      err_after_s=self.scn.failed_post_err_after_s)
            elif self.scn.fail_aux_posts_of_prefill_rank == self.tp_rank:
                from sglang_disagg_ext.selftest.harness import faults

                self.dropped = faults.fail_nixl_posts(self.mgr, 1, kind="aux",
                                                      err_after_s=self.scn.failed_post_err_after_s)
        else:
            self._run_decode_manager_hook()
        self.KVPoll = ss.kvpoll()
        self.mark("manager")

        if self.role == "decode" and self.scn.decode_pending_queue:
            # Requests start once prefill's bootstrap server answers (what a router's health check
            # gives a real decode); reading the answer is left to each request, as SGLang does.
            self._wait_bootstrap_answer(deadline)
            self.mark("prefill_info")
        elif self.role == "decode":
            while not ss.try_ensure_prefill_info(self.mgr, self.bootstrap_addr):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"prefill never registered at bootstrap server {self.bootstrap_addr} "
                        f"within startup_s={self.scn.timeouts.startup_s}"
                    )
                time.sleep(0.1)
            self.mark("prefill_info")
            if self.args.ready_files:
                # Prefill registers at the bootstrap server before its transfer
                # engine exists; SGLang's waiting timeout (short here) starts at
                # send_metadata, so start requests only once every prefill
                # rank has its manager.
                _wait_ready(self.args.ready_files.split(os.pathsep), deadline)
                self.mark("prefill_ready")

    def _build_pools(self, dtype) -> None:
        """KV pool, aux buffers, state components; fill patterns (prefill) or sentinel (decode)."""
        import torch

        from sglang_disagg_ext.selftest.harness import patterns
        from sglang_disagg_ext.selftest.harness.scenario import AUX_POOL_ID, KV_POOL_ID, STATE_POOL_BASE

        ss, scn = self.ss, self.scn
        device = self.opts.device
        self.kv_heads = None  # multi-rank: the global KV heads this rank holds
        pool_heads = scn.kv.head_num
        if scn.multi_rank:
            pool_heads = patterns.heads_per_rank(scn.kv.head_num, self.tp_size)
            try:
                self.kv_heads = patterns.rank_kv_heads(scn.kv.head_num, self.tp_size, self.tp_rank)
            except ValueError:
                self.kv_heads = None  # a layout SGLang cannot shard: bytes are not checked
        head_dim = scn.decode_kv_head_dim if self.role == "decode" and scn.decode_kv_head_dim else scn.kv.head_dim
        self.kv_pool = ss.make_mha_pool(
            scn.kv.num_pages, self.page_size, dtype, pool_heads, head_dim, scn.num_layers, device=device
        )
        ptrs, lens, items = self.kv_pool.get_contiguous_buf_infos()
        self.pools = [_Pool(KV_POOL_ID, "kv", ss.mha_pool_tensors(self.kv_pool), ptrs, lens, items)]

        hidden = scn.decode_hidden_size if self.role == "decode" and scn.decode_hidden_size else scn.hidden_size
        self.meta = ss.make_metadata_buffers(
            scn.aux_rows, hidden, dtype, kv_checksum=scn.kv_checksum_on in (self.role, "both")
        )
        ptrs, lens, items = self.meta.get_buf_infos()
        self.pools.append(_Pool(AUX_POOL_ID, "aux", ss.metadata_tensors(self.meta, ptrs), ptrs, lens, items))

        self.state_components = []
        self._state_keepalive = []
        # Multi-rank: pool id -> (total heads, bytes per head, element size, layers,
        # the global heads this rank holds) of each paged state pool, sharded like
        # the KV heads.
        self.state_heads: Dict[int, tuple] = {}
        for c, spec in enumerate(scn.state_pools):
            layout = None
            if spec.paged:
                state_dtype = ss.torch_dtype(spec.dtype)
                heads = spec.head_num
                if scn.multi_rank:
                    heads = patterns.heads_per_rank(spec.head_num, self.tp_size)
                    try:
                        held = patterns.rank_kv_heads(spec.head_num, self.tp_size, self.tp_rank)
                    except ValueError:
                        held = None  # a layout SGLang cannot shard: bytes are not checked
                    if held is not None:
                        size = torch.empty((), dtype=state_dtype).element_size()
                        self.state_heads[STATE_POOL_BASE + c] = (
                            spec.head_num, spec.head_dim * size, size, spec.num_layers, held
                        )
                pool = ss.make_mha_pool(
                    spec.num_pages, self.page_size, state_dtype, heads, spec.head_dim,
                    spec.layers_on(self.role), device=device,
                )
                self._state_keepalive.append(pool)
                tensors = ss.mha_pool_tensors(pool)
                ptrs, lens, items = pool.get_contiguous_buf_infos()
                layout = ss.pool_kv_cache_layout(pool)
            else:  # mamba: per state tensor, per layer, num_pages slots
                tensors = [
                    torch.zeros((spec.num_pages, nbytes), dtype=torch.uint8, device=device)
                    for nbytes in spec.mamba_item_bytes
                    for _ in range(spec.num_layers)
                ]
                ptrs = [t.data_ptr() for t in tensors]
                lens = [t.nbytes for t in tensors]
                items = [t[0].nbytes for t in tensors]
            name = f"state{c}:{spec.kind}"
            self.pools.append(_Pool(STATE_POOL_BASE + c, name, tensors, ptrs, lens, items))
            self.state_components.append(ss.StateComponent(spec.kind, ptrs, lens, items, kv_cache_layout=layout))

        expected_pages = {KV_POOL_ID: scn.kv.num_pages, AUX_POOL_ID: scn.aux_rows}
        for c, spec in enumerate(scn.state_pools):
            expected_pages[STATE_POOL_BASE + c] = spec.num_pages
        for pool in self.pools:
            if pool.num_pages != expected_pages[pool.pool_id]:
                raise RuntimeError(
                    f"{pool.name}: buffers hold {pool.num_pages} pages, scenario says "
                    f"{expected_pages[pool.pool_id]}"
                )
            for b, view in enumerate(pool.views):
                if self.role == "prefill" and pool.pool_id == KV_POOL_ID and self.kv_heads is not None:
                    src = patterns.kv_rank_buffer(
                        b, pool.num_pages, scn.page_size, scn.kv.head_num, self._head_bytes(), self.kv_heads
                    )
                    view.copy_(torch.from_numpy(src))
                elif self.role == "prefill" and pool.pool_id in self.state_heads:
                    total, head_bytes, _, _, held = self.state_heads[pool.pool_id]
                    src = patterns.kv_rank_buffer(
                        b, pool.num_pages, scn.page_size, total, head_bytes, held, pool_id=pool.pool_id
                    )
                    view.copy_(torch.from_numpy(src))
                elif self.role == "prefill":
                    src = patterns.buffer_pattern(pool.pool_id, b, pool.num_pages, pool.item_bytes[b])
                    view.copy_(torch.from_numpy(src))
                else:
                    view.fill_(patterns.SENTINEL)
        if self.opts.device_type == "cuda":
            # Copies from pageable host memory may still be in flight when
            # copy_ returns; the engine reads these pages right after.
            torch.cuda.synchronize(device)
        self.result["pools"] = [
            {
                "name": p.name,
                "buffers": len(p.views),
                "pages": p.num_pages,
                "item_bytes": sorted(set(p.item_bytes)),
                "device": p.device,
            }
            for p in self.pools
        ]

    def _rank_barrier(self) -> None:
        """Multi-rank: the ranks of one side meet here once per request.

        Prefill ranks meet before they make their senders; decode ranks right
        before send_metadata (see :meth:`run_decode`). Ranks on shared cores
        must not drift apart.
        """
        if getattr(self, "tp_size", 1) <= 1:
            return
        import datetime

        import torch.distributed as dist

        dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.scn.timeouts.request_s))

    def _dtype_size(self) -> int:
        import torch

        return torch.empty((), dtype=self.ss.torch_dtype(self.scn.kv.dtype)).element_size()

    def _head_bytes(self) -> int:
        """Bytes of one KV head of one token (head_dim x dtype size)."""
        return self.scn.kv.head_dim * self._dtype_size()

    # -- requests ------------------------------------------------------------
    def _poll_until(self, obj, targets, deadline, trace: list, give_up=None) -> str:
        """Poll ``obj`` until its state name is in ``targets`` or the deadline passes.

        ``give_up`` (optional, checked a few times a second) ends the wait early.
        """
        last = None
        next_check = time.monotonic() + 0.25
        while True:
            name = self.ss.poll_name(obj.poll())
            if name != last:
                trace.append([name, round(_now(), 3)])
                last = name
            if name in targets:
                return name
            now = time.monotonic()
            if now > deadline:
                return name
            if give_up is not None and now >= next_check:
                next_check = now + 0.25
                if give_up():
                    return name
            time.sleep(POLL_SLEEP_S)

    def _decode_gave_up(self, room: int):
        """For prefill: a check that says decode ended ``room`` a while ago.

        A stock prefill whose transfer thread died never leaves WaitingForInput;
        once decode has reached a final state for the room (its own timeout),
        prefill stops waiting after ``PEER_GRACE_S`` instead of the full bound.
        """
        path = self.args.peer_result
        if not path:
            return None
        seen = {"t": None}

        def check() -> bool:
            if seen["t"] is None:
                try:
                    with open(path) as f:
                        peer = json.load(f)
                except (OSError, ValueError):
                    return False
                final = any(r.get("room") == room and r.get("status") in FINAL for r in peer.get("requests", []))
                if peer.get("done") or final:
                    seen["t"] = time.monotonic()
                return False
            return time.monotonic() - seen["t"] >= PEER_GRACE_S

        return check

    def _state_lists(self, req, side: str):
        kinds = [s.kind for s in req.state]
        lists = [getattr(s, side) for s in req.state]
        return self.ss.state_payload(kinds, lists)

    def run_prefill(self, index: int, rec: Dict[str, Any]) -> None:
        import numpy as np

        req = self.scn.requests[index]
        deadline = time.monotonic() + self.scn.timeouts.request_s
        if not req.prefill_admits:
            from sglang_disagg_ext.selftest.harness.scenario import NOT_ADMITTED

            # No sender: wait, as a scheduler that never saw the request, until decode ended the
            # room (or the bound), so that the next request's bootstrap clock starts after it.
            give_up = self._decode_gave_up(rec["room"])
            while time.monotonic() < deadline and not (give_up is not None and give_up()):
                time.sleep(0.1)
            rec["status"] = NOT_ADMITTED
            return
        if req.decode_ends_first:
            self._wait_decode_ended(rec["room"], deadline)
        t_open = time.monotonic()
        sender = self.ss.make_sender(self.classes["sender"], self.mgr, self.bootstrap_addr, rec["room"])
        rec["sender_class"] = self.ss.class_name(sender)
        rec["phases"]["sender"] = round(time.time(), 3)
        if self.scn.decode_waits_for_prefill_sender:
            self.write_result()  # decode makes this room's receiver once it reads the sender's phase
        trace = rec["polls"]
        # A room decode ended first: watched to prefill's own end (its bootstrap timeout, for stock).
        give_up = None if req.decode_ends_first else self._decode_gave_up(rec["room"])
        state = self._poll_until(sender, ("WaitingForInput",) + FINAL, deadline, trace, give_up)
        if state != "WaitingForInput":
            if state not in FINAL:
                # Stuck before any transfer: say where the engine's own threads are.
                _print_engine_thread_stacks(f"prefill room {rec['room']} still {state}")
            rec["status"] = state
            if req.decode_ends_first:
                rec["seconds"] = round(time.monotonic() - t_open, 4)  # from the room's opening
            return
        src = list(req.src_kv_pages)
        rec["phases"]["bootstrapped"] = round(time.time(), 3)
        sender.init(len(src), req.aux_index)
        chunks = _split(src, req.send_chunks)
        t_send = time.monotonic()
        for i, chunk in enumerate(chunks):
            pages = np.asarray(chunk, dtype=np.int32)
            if i == len(chunks) - 1:
                sender.send(pages, state_indices=self._state_lists(req, "src_pages"))
            else:
                sender.send(pages)
        rec["status"] = self._poll_until(sender, FINAL, deadline, trace, give_up)
        rec["seconds"] = round(time.monotonic() - t_send, 4)

    def run_decode(self, index: int, rec: Dict[str, Any]) -> None:
        import numpy as np

        req = self.scn.requests[index]
        deadline = time.monotonic() + self.scn.timeouts.request_s
        addr = self._unanswering_addr() if req.prefill_unanswered else self.bootstrap_addr
        if self.scn.decode_waits_for_prefill_sender:
            self._wait_prefill_sender(rec["room"], deadline)
        receiver = self.ss.make_receiver(self.classes["receiver"], self.mgr, addr, rec["room"])
        rec["receiver_class"] = self.ss.class_name(receiver)
        rec["phases"]["receiver"] = round(time.time(), 3)
        trace = rec["polls"]
        t_made = time.monotonic()
        if req.decode_ends_first:
            # Bootstrapped (init: prefill's rank endpoints known) and ended before its metadata (a
            # pre-allocation that waited for KV memory, then the client's abort): SGLang's abort
            # fails the room here and sends its ABORT to prefill's ranks.
            receiver.init(0)
            receiver.abort()
            rec["status"] = self._poll_until(receiver, FINAL, deadline, trace)
            rec["seconds"] = round(time.monotonic() - t_made, 4)
            self.verify(index, rec)
            return
        if self.scn.decode_pending_queue and not self._ensure_prefill_info_as_queued(receiver, trace, addr, rec):
            state = self._poll_until(receiver, FINAL, deadline, trace)
            rec["seconds"] = round(time.monotonic() - t_made, 4)
            rec["status"] = state
            self.verify(index, rec)
            return
        receiver.init(0)
        rec["phases"]["init"] = round(time.time(), 3)
        state = self._poll_until(receiver, ("WaitingForInput",) + FINAL, deadline, trace)
        # SGLang's waiting timeout runs from each rank's send_metadata and the
        # prefill serves the room only once every decode rank has sent: a rank
        # whose init took seconds (its bootstrap-server query) must not leave
        # the others' clocks running. Every rank reaches this barrier.
        self._rank_barrier()
        rec["phases"]["barrier"] = round(time.time(), 3)
        if state == "WaitingForInput":
            if req.decode_metadata_delay_s:
                time.sleep(req.decode_metadata_delay_s)
                deadline += req.decode_metadata_delay_s
            t_send = time.monotonic()
            rec["phases"]["send"] = round(time.time(), 3)
            receiver.send_metadata(
                np.asarray(req.dst_kv_pages, dtype=np.int32),
                req.decode_aux_index,
                self._state_lists(req, "dst_pages"),
            )
            state = self._poll_until(receiver, FINAL, deadline, trace)
            rec["seconds"] = round(time.monotonic() - t_send, 4)
        rec["status"] = state
        self._run_decode_hook(rec)
        self.verify(index, rec)

    def _wait_bootstrap_answer(self, deadline: float) -> None:
        import requests

        url = (f"http://{self.bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
               f"&target_tp_rank=-1&target_pp_rank=-1")
        while True:
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill's bootstrap server {self.bootstrap_addr} never answered within "
                                   f"startup_s={self.scn.timeouts.startup_s}")
            time.sleep(0.1)

    # SGLang's pending queue: one attempt a second, 15 attempts (``Scenario.pending_queue_tries``),
    # then the receiver aborted (``_ensure_retry_interval``, ``_max_ensure_retries``: the same in every
    # wheel 0.5.10.post1-0.5.23). Stock's second runs from the try's start: a try that took longer
    # is followed at once.
    QUEUE_RETRY_S = 1.0

    def _ensure_prefill_info_as_queued(self, receiver, trace: list, addr: str, rec: Dict[str, Any]) -> bool:
        """What ``DecodePreallocQueue._ensure_prefill_info`` does for one waiting request (the
        harness stands in for decode's scheduler): True once prefill's info is there; False when
        the receiver was ended meanwhile (a refusal) or the tries ran out (receiver aborted).
        ``rec["lookup_seconds"]``: how long each try held the (stand-in) scheduler thread."""
        held = rec.setdefault("lookup_seconds", [])
        for _ in range(self.scn.pending_queue_tries):
            t_try = time.monotonic()
            ready = self.ss.try_ensure_prefill_info(self.mgr, addr)
            held.append(round(time.monotonic() - t_try, 4))
            if ready:
                return True
            name = self.ss.poll_name(receiver.poll())
            trace.append([name, round(_now(), 3)])
            if name in FINAL:
                return False
            time.sleep(max(0.0, self.QUEUE_RETRY_S - (time.monotonic() - t_try)))
        receiver.abort()
        return False

    def _watch_decode_aborts(self) -> None:
        """Prefill, a scenario with ``decode_ends_first`` rooms: note each room whose ABORT this manager's
        bootstrap thread has handled. Wraps the manager's ``_handle_abort_notification`` (SGLang's
        bootstrap loop offers it every decode message, 0.5.16+ NIXL, 0.5.22+ Mooncake; the -ext class's
        own override runs inside it unchanged): decode's ABORT travels on a socket of its own, so
        decode's result file alone does not say it reached prefill before the room opens."""
        self._aborts_handled = None
        handler = getattr(self.mgr, "_handle_abort_notification", None)
        if handler is None or not any(r.decode_ends_first for r in self.scn.requests):
            return
        seen = self._aborts_handled = set()

        def handle_and_note(msg):
            try:
                return handler(msg)
            finally:
                if msg and msg[0] == b"ABORT" and len(msg) > 1 and msg[1].isdigit():
                    seen.add(int(msg[1]))

        self.mgr._handle_abort_notification = handle_and_note

    def _wait_decode_ended(self, room: int, deadline: float) -> None:
        """Prefill (``RequestSpec.decode_ends_first``): wait until decode's result file shows ``room``
        final and, where the bootstrap loop hands ABORTs to a handler (``_watch_decode_aborts``),
        until that handler has taken decode's ABORT for it; or the request's bound."""
        _wait_peer_result(self.args.peer_result, deadline,
                          lambda r: r.get("room") == room and r.get("status") in FINAL)
        while self._aborts_handled is not None and room not in self._aborts_handled and time.monotonic() < deadline:
            time.sleep(0.01)

    def _wait_prefill_sender(self, room: int, deadline: float) -> None:
        """Decode (``Scenario.decode_waits_for_prefill_sender``): wait until prefill's result file
        shows ``room``'s sender made, or the request's bound (then go on: the room ends as it would)."""
        path = self.args.ready_files.split(os.pathsep)[0] if self.args.ready_files else None
        _wait_peer_result(path, deadline, lambda r: r.get("room") == room and "sender" in r.get("phases", {}))

    def _unanswering_addr(self) -> str:
        """A bootstrap address on loopback whose socket listens and never accepts: the kernel
        completes each connection, the HTTP request is sent and no answer comes (a prefill behind
        a link that drops packets). One per worker, closed when it exits."""
        if getattr(self, "_unanswering", None) is None:
            import socket

            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            self._unanswering = sock
        return f"127.0.0.1:{self._unanswering.getsockname()[1]}"

    def _run_decode_hook(self, rec: Dict[str, Any]) -> None:
        """``SGLANG_HARNESS_DECODE_HOOK=<file.py>:<function>``: call ``function(pools,
        rec)`` after the transfer and before verification. The harness's own tests
        use it (``test/support/tamper.py``) to show the verification sees a single
        wrong byte; nothing in the package sets it."""
        hook = _load_hook(DECODE_HOOK_ENV)
        if hook is not None:
            hook(self.pools, rec)

    def _run_prefill_hook(self) -> None:
        """``SGLANG_HARNESS_PREFILL_HOOK=<file.py>:<function>``: call ``function(manager)``
        once, right after the prefill manager exists and before any request. Tests
        use it to inject a fault into one manager method (``test/support/``);
        nothing in the package sets it. A hook may return an object with a
        ``report()`` dict: it is written with each result (``prefill_hook_report``),
        for what the hook saw that the requests' records cannot say."""
        hook = _load_hook(PREFILL_HOOK_ENV)
        if hook is not None:
            self.result["prefill_hook"] = os.environ[PREFILL_HOOK_ENV]
            state = hook(self.mgr)
            if callable(getattr(state, "report", None)):
                self.prefill_hook_state = state

    def _run_decode_manager_hook(self) -> None:
        """``SGLANG_HARNESS_DECODE_MANAGER_HOOK=<file.py>:<function>``: as the prefill hook,
        on each decode rank's manager, right after it exists and before any request."""
        hook = _load_hook(DECODE_MANAGER_HOOK_ENV)
        if hook is not None:
            self.result["decode_manager_hook"] = os.environ[DECODE_MANAGER_HOOK_ENV]
            hook(self.mgr)

    def verify(self, index: int, rec: Dict[str, Any]) -> None:
        from sglang_disagg_ext.selftest.harness import patterns

        # Earlier requests whose bytes this rank holds: their pages must still hold them
        # (a stray write of this request into one is seen now). One whose bytes were
        # already wrong was reported at its own check; its pages hold nothing derivable.
        held = {
            r["index"] for r in self.result["requests"]
            if r["index"] < index and r.get("status") == "Success" and r.get("bytes_verified")
        }
        expected = patterns.expected_after_request(self.scn, index, held)
        mismatches: List[str] = []
        for pool in self.pools:
            exp = expected[pool.pool_id]
            for b, view in enumerate(pool.views):
                if self._rank_heads(pool.pool_id) is not None:
                    mismatches += self._compare_rank_buffer(pool, b, view, exp)
                    continue
                src_b, others = patterns.source_buffer(self.scn, pool.pool_id, b, len(pool.views))
                mismatches += patterns.compare_buffer(
                    view, pool.pool_id, src_b, exp if src_b is not None else patterns.untouched(exp),
                    f"{pool.name} buffer {b}", identify_buffers=others,
                )
        rec["mismatches"] = mismatches
        rec["bytes_verified"] = not mismatches
        rec["expected_writes"] = {
            expected[p.pool_id].name: len(expected[p.pool_id].writes) for p in self.pools
        }

    def _rank_heads(self, pool_id: int):
        """Multi-rank runs: (total heads, bytes per head, element size, layers, heads held)
        of pool ``pool_id`` when this decode rank holds a head share of it (KV, paged
        state), else None (aux rows, single-rank pools: compared whole)."""
        from sglang_disagg_ext.selftest.harness.scenario import KV_POOL_ID

        if pool_id == KV_POOL_ID and getattr(self, "kv_heads", None) is not None:
            return (self.scn.kv.head_num, self._head_bytes(), self._dtype_size(), self.scn.num_layers, self.kv_heads)
        return getattr(self, "state_heads", {}).get(pool_id)

    def _compare_rank_buffer(self, pool, b: int, view, exp) -> List[str]:
        """One buffer of a pool this rank holds a head share of, every element of its heads
        (patterns copies device tensors to host before comparing)."""
        from sglang_disagg_ext.selftest.harness import patterns

        total, head_bytes, size, layers, held = self._rank_heads(pool.pool_id)
        return patterns.compare_kv_rank_buffer(
            view, b, exp, num_layers=layers, page_size=self.scn.page_size, total_heads=total,
            head_bytes=head_bytes, heads=held, dtype_size=size,
            label=f"decode rank {self.tp_rank} {pool.name} buffer {b}", pool_id=pool.pool_id,
        )

    def run_requests(self) -> None:
        if self.scn.wave > 1:
            self.run_waves()
            return
        for index in range(len(self.scn.requests)):
            room = self.scn.room_of(index)
            t0 = _now()
            rec: Dict[str, Any] = {
                "index": index,
                "room": room,
                "status": None,
                "seconds": None,
                "polls": [],
                "error": None,
                # Wall-clock times, comparable across the ranks' processes.
                "phases": {},
            }
            self.result["requests"].append(rec)
            try:
                if self.role == "prefill":
                    self._rank_barrier()
                    rec["phases"]["barrier"] = round(time.time(), 3)
                    self.run_prefill(index, rec)
                else:
                    self.run_decode(index, rec)
            except Exception:
                rec["error"] = traceback.format_exc(limit=8)[-4000:]
            rec["timed_out"] = rec["status"] not in FINAL
            rec["total_seconds"] = round(_now() - t0, 4)
            if rec["status"] == "Failed" or rec["error"]:
                rec["failure_reason"] = self.ss.failure_reason(self.mgr, room)
            rec["log"] = self.logs.since(t0)
            rec["thread_errors"] = self.thread_errors.since(t0)
            self.write_result()

    # -- waves (the soak) ----------------------------------------------------
    def run_waves(self) -> None:
        """``scn.wave`` requests at a time: every sender/receiver of a wave is made, then
        each is sent, then all are polled to a final state, as a scheduler holding
        that many requests does. Decode checks the wave's bytes, then resets its pools."""
        self._threads_at_start = {t.ident: t.name for t in threading.enumerate()}
        if self.role == "prefill":
            self._wait_decode_setup()
        self.result["waves"] = []
        for w, indices in enumerate(self.scn.waves()):
            if w < self.args.first_wave:
                continue
            if w == self.args.first_wave and w > 0 and self.args.ready_files:
                # A restarted decode starts where prefill is: the harness runs prefill's
                # waves one after another, and prefill spends the killed wave waiting out
                # the bootstrap timeout of the rooms whose metadata never came. A real
                # prefill scheduler serves the new decode meanwhile; here the new decode
                # waits instead of burning its own waiting timeout on that artefact.
                _wait_ready(self.args.ready_files.split(os.pathsep),
                            time.monotonic() + 2 * self.scn.timeouts.request_s, wave=w - 1)
            if self.role == "decode":
                # Each decode process serves its own requests: the second (mismatched) decode
                # those of the mismatched peer, the first every other one.
                from sglang_disagg_ext.selftest.harness.scenario import MISMATCHED_PEER

                indices = [i for i in indices
                           if (self.scn.requests[i].fault == MISMATCHED_PEER) == self.args.mismatched_peer]
                if not indices:
                    continue
                if self.args.mismatched_peer and w > 0 and self.args.ready_files:
                    # Prefill makes this wave's senders once it finished the wave before.
                    _wait_ready(self.args.ready_files.split(os.pathsep),
                                time.monotonic() + 2 * self.scn.timeouts.request_s, wave=w - 1)
            if self.role == "prefill" and w > 0 and w - 1 != self.scn.restart_decode_in_wave:
                self._wait_decode_wave(w - 1)
            t0 = _now()
            recs = []
            for index in indices:
                rec = {"index": index, "room": self.scn.room_of(index), "status": None, "seconds": None,
                       "error": None, "wave": w}
                self.result["requests"].append(rec)
                recs.append(rec)
            wave = {"wave": w, "requests": len(indices)}
            if self.role == "prefill" and self.scn.fails_posts and getattr(self, "dropped", None) is not None:
                # The last wave shows the workers still serve; the killed wave's requests
                # are lost with their decode whatever happens: no fault in either.
                self.dropped.active = w not in (len(self.scn.waves()) - 1, self.scn.restart_decode_in_wave)
            try:
                if self.role == "prefill":
                    self._prefill_wave(indices, recs)
                else:
                    self._decode_wave(indices, recs, wave)
            except Exception:
                err = traceback.format_exc(limit=8)[-4000:]
                for rec in recs:
                    rec["error"] = rec["error"] or err
            for rec in recs:
                rec["timed_out"] = rec["status"] not in FINAL
                if rec["status"] == "Failed" or rec["error"]:
                    rec["failure_reason"] = self.ss.failure_reason(self.mgr, rec.get("object_room", rec["room"]))
                rec["log"] = []
                rec["thread_errors"] = self.thread_errors.since(t0)
            wave["seconds"] = round(_now() - t0, 3)
            self.result["waves"].append(wave)
            self.result["threads_died"] = sorted(
                f"{name} (ident {ident})" for ident, name in self._threads_at_start.items()
                if ident not in {t.ident for t in threading.enumerate()}
            )
            self.write_result()

    def _wait_decode_setup(self) -> None:
        """Prefill, before its first wave: wait until decode has finished its setup (its
        result file shows its manager: decode writes it first once setup is done, every
        prefill rank ready), for at most ``startup_s``; a decode that failed in setup
        ends the wait at once (``_wait_ready``, the wait decode makes for prefill).

        Each sender starts SGLang's bootstrap clock when it is made. Without this wait
        prefill's first wave started as soon as prefill itself was ready, so its clocks also
        counted decode's remaining start-up (imports, pools, manager) and not only the
        transfer: on a loaded machine that lag passed the 8 s bootstrap timeout and every
        room of the first wave failed (a CI run on 0.5.23, NIXL soak), while the later
        waves, which wait for decode's previous wave (``_wait_decode_wave``), passed."""
        if not self.args.peer_result:
            return
        try:
            _wait_ready([self.args.peer_result], time.monotonic() + self.scn.timeouts.startup_s)
        except (RuntimeError, TimeoutError):
            return  # decode failed in setup or never came: its rooms end as they would have
        self.mark("decode_set_up")

    def _wait_decode_wave(self, w: int) -> None:
        """Prefill: start the next wave once decode has finished wave ``w`` (its result
        file, or its restarted successor's, says so), for at most one wave bound.

        A scheduler makes a request's sender when the request arrives, about when
        decode sends its metadata; a harness side that raced a wave ahead would
        start its bootstrap clock while the other still waits out a failed room's
        timeout of the wave before, and fail rooms for the rig's sake."""
        from sglang_disagg_ext.selftest.harness.run import RESTARTED_DECODE

        if not self.args.peer_result:
            return
        paths = [self.args.peer_result,
                 os.path.join(os.path.dirname(self.args.peer_result), f"{RESTARTED_DECODE}.json")]
        deadline = time.monotonic() + self.scn.timeouts.request_s
        while time.monotonic() < deadline:
            for path in paths:
                try:
                    with open(path) as f:
                        peer = json.load(f)
                except (OSError, ValueError):
                    continue
                if peer.get("error") or any(x.get("wave", -1) >= w for x in peer.get("waves") or []):
                    return
            time.sleep(0.02)

    def _poll_all(self, objs: Dict[int, Any], targets, deadline: float) -> Dict[int, str]:
        """Poll each object until its state is in ``targets`` or the deadline passes; index -> state."""
        states = {i: None for i in objs}
        while True:
            for i, obj in objs.items():
                if states[i] not in targets and states[i] != POLL_RAISED:
                    states[i] = self._poll_one(i, obj)
            if all(st in targets or st == POLL_RAISED for st in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(POLL_SLEEP_S)

    def _poll_one(self, i: int, obj) -> str:
        """``obj.poll()``'s state name; POLL_RAISED when it raised (in a server, into the
        scheduler loop): recorded on request ``i`` (``_poll_raised``), never polled again,
        and the rest of its wave goes on."""
        try:
            return self.ss.poll_name(obj.poll())
        except Exception as exc:
            from sglang_disagg_ext.selftest.harness.scenario import RAISED_INTO_CALLER

            self._poll_raised[i] = f"{RAISED_INTO_CALLER}poll: {type(exc).__name__}: {exc}"[:2000]
            return POLL_RAISED

    def _prefill_wave(self, indices: List[int], recs: List[Dict[str, Any]]) -> None:
        import numpy as np

        def send(sender, req) -> None:
            sender.init(len(req.src_kv_pages), req.aux_index)
            sender.send(np.asarray(req.src_kv_pages, dtype=np.int32), state_indices=self._state_lists(req, "src_pages"))

        from sglang_disagg_ext.selftest.harness.scenario import NOT_ADMITTED

        self._rank_barrier()  # multi-rank: the prefill ranks start each wave together
        admitted = [(i, rec) for i, rec in zip(indices, recs) if self.scn.requests[i].prefill_admits]
        for i, rec in zip(indices, recs):
            if not self.scn.requests[i].prefill_admits:
                rec["status"] = NOT_ADMITTED  # no sender: decode's metadata for it names no request here
        senders = {i: self.ss.make_sender(self.classes["sender"], self.mgr, self.bootstrap_addr, rec["room"])
                   for i, rec in admitted}
        self._wave_transfer(senders, [i for i, _ in admitted], [rec for _, rec in admitted], send)

    def _decode_wave(self, indices: List[int], recs: List[Dict[str, Any]], wave: Dict[str, Any]) -> None:
        import numpy as np

        crash_after = len(indices) // 2 if recs and recs[0]["wave"] == self.args.crash_in_wave else None
        sent = []

        def send_metadata(receiver, req) -> None:
            if crash_after is not None and len(sent) == crash_after:
                # A decode that dies mid-wave: some rooms have their metadata out (prefill
                # may be writing them), the rest never will. Nothing is flushed or closed.
                print(f"[harness decode] SIGKILL self in wave {self.args.crash_in_wave}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            receiver.send_metadata(np.asarray(req.dst_kv_pages, dtype=np.int32), req.decode_aux_index,
                                   self._state_lists(req, "dst_pages"))
            sent.append(req)

        receivers = {}
        for i, rec in zip(indices, recs):
            receivers[i] = self.ss.make_receiver(self.classes["receiver"], self.mgr, self.bootstrap_addr, rec["room"])
            receivers[i].init(0)
        self._wave_transfer(receivers, indices, recs, send_metadata)
        self._verify_wave(indices, recs, wave)

    def _wave_transfer(self, objs: Dict[int, Any], indices: List[int], recs: List[Dict[str, Any]], start) -> None:
        """Every sender/receiver of the wave to WaitingForInput, then ``start(obj, request)``
        on each that got there, then all of those to a final state; one deadline for the
        wave. Records each request's status and seconds from its start to its final state."""
        deadline = time.monotonic() + self.scn.timeouts.request_s
        self._poll_raised: Dict[int, str] = {}
        states = self._poll_all(objs, ("WaitingForInput",) + FINAL, deadline)
        if self.role == "decode":
            # Multi-rank: SGLang's waiting timeout runs from each rank's send_metadata and
            # prefill serves a room once every decode rank has sent (see run_decode).
            self._rank_barrier()
        started = {}
        for i, rec in zip(indices, recs):
            if states[i] != "WaitingForInput":
                rec["status"] = None if states[i] == POLL_RAISED else states[i]
                continue
            started[i] = time.monotonic()
            try:
                start(objs[i], self.scn.requests[i])
            except Exception as exc:
                # One request's call raising must not take its wave's records along:
                # record it on that request (where its object was left), go on.
                from sglang_disagg_ext.selftest.harness.scenario import RAISED_INTO_CALLER

                del started[i]
                rec["error"] = f"{RAISED_INTO_CALLER}{type(exc).__name__}: {exc}"[:2000]
                st = self._poll_one(i, objs[i])
                rec["status"] = None if st == POLL_RAISED else st
        ends = self._poll_all_timed({i: objs[i] for i in started}, deadline)
        for i, rec in zip(indices, recs):
            # The room SGLang's object was built with: the request's own, except for a
            # duplicate F16 refused (a private room, where its failure reason is recorded).
            rec["object_room"] = getattr(objs[i], "bootstrap_room", rec["room"])
            if i in started:
                rec["status"], t_end = ends[i]
                rec["seconds"] = round(t_end - started[i], 4)
                if rec["status"] == POLL_RAISED:
                    rec["status"] = None
            if i in self._poll_raised and not rec["error"]:
                rec["error"] = self._poll_raised[i]

    def _poll_all_timed(self, objs: Dict[int, Any], deadline: float) -> Dict[int, tuple]:
        """As ``_poll_all`` to a final state, with the time each was first seen final."""
        out: Dict[int, tuple] = {}
        while True:
            now = time.monotonic()
            for i, obj in objs.items():
                if i not in out:
                    st = self._poll_one(i, obj)
                    if st in FINAL or st == POLL_RAISED:
                        out[i] = (st, now)
            if len(out) == len(objs) or now > deadline:
                for i, obj in objs.items():
                    if i not in out:
                        out[i] = (self._poll_one(i, obj), now)
                return out
            time.sleep(POLL_SLEEP_S)

    def _verify_wave(self, indices: List[int], recs: List[Dict[str, Any]], wave: Dict[str, Any]) -> None:
        """Each Success room's pages hold its source bytes; every page no room of the wave
        targets holds the sentinel (a write there is a stray, reported for the wave); the
        pages of a room that did not succeed are not checked. Then every pool back to the
        sentinel for the next wave."""
        from sglang_disagg_ext.selftest.harness import patterns

        statuses = {i: rec["status"] for i, rec in zip(indices, recs)}
        per_room, stray = patterns.wave_expectations(self.scn, statuses)
        for i, rec in zip(indices, recs):
            rec["mismatches"] = []
        def compare(pool, b, view, exp) -> List[str]:
            if self._rank_heads(pool.pool_id) is not None:  # multi-rank: this rank's heads
                return self._compare_rank_buffer(pool, b, view, exp)
            return patterns.compare_buffer(view, pool.pool_id, b, exp, f"{pool.name} buffer {b}")

        wave.setdefault("stray_writes", [])
        for pool in self.pools:
            for b, view in enumerate(pool.views):
                for i, rec in zip(indices, recs):
                    if i in per_room:
                        rec["mismatches"] += compare(pool, b, view, per_room[i][pool.pool_id])
                wave["stray_writes"] += compare(pool, b, view, stray[pool.pool_id])
        for i, rec in zip(indices, recs):
            rec["bytes_verified"] = i in per_room and not rec["mismatches"]
        for pool in self.pools:
            for view in pool.views:
                view.fill_(patterns.SENTINEL)

    def main(self) -> int:
        try:
            self.setup()
            self.write_result()
            self.run_requests()
            self.mark("requests_done")
        except BaseException:
            self.result["error"] = traceback.format_exc()[-6000:]
            print(self.result["error"], file=sys.stderr, flush=True)
        finally:
            self.result["done"] = True
            self.result["timings"]["total"] = round(_now(), 3)
            self.write_result()
        sent = _counter_samples("verify_mismatch_notices_sent_total", "prefill")
        _touch(self.args.done_file, sent)
        # Every rank stays up until every rank is done. Prefill keeps the
        # bootstrap server and its status sync up for decode. Decode keeps its
        # engine up for writes still in flight from slower prefill ranks: stock
        # decode reaches Success on the first aux notification (NIXL
        # received_aux is one bool), and an agent torn down under another
        # rank's posted transfer fails that rank with NIXL_ERR_REMOTE_DISCONNECT.
        limit = getattr(getattr(self, "scn", None), "timeouts", None)
        wait_s = 5.0 if limit is None else limit.request_s + 5.0
        end = time.monotonic() + wait_s
        done_files = self.args.done_files.split(os.pathsep) if self.args.done_files else [self.args.done_file]
        while time.monotonic() < end and not all(os.path.exists(f) for f in done_files):
            time.sleep(0.05)
        # Once more, for counters that move after this rank's own requests ended: a decode's
        # verification-mismatch notice reaches prefill after prefill concluded the room.
        from sglang_disagg_ext.selftest.harness.scenario import MISMATCH_NOTICE_WAIT_S

        if self.role == "prefill":
            self._await_mismatch_notices(done_files, time.monotonic() + MISMATCH_NOTICE_WAIT_S)
            _touch(_counted_file(self.args.done_file))
        elif sent:
            # A decode that sent mismatch notices stays up until every prefill rank has
            # counted them: its notices are queued on ZMQ sockets that die with this
            # process, and one exiting at once lost its notice (clean-clone CI, 0.5.23).
            counted = [_counted_file(f) for f in done_files if os.path.basename(f).startswith("prefill")]
            end = time.monotonic() + MISMATCH_NOTICE_WAIT_S + 2.0
            while time.monotonic() < end and not all(os.path.exists(f) for f in counted):
                time.sleep(0.05)
        self.write_result()
        sys.stdout.flush()
        sys.stderr.flush()
        return 0


    def _await_mismatch_notices(self, done_files, deadline: float) -> None:
        """Until this prefill rank's bootstrap thread has counted every mismatch notice the
        decode ranks say (in their done files) they sent to its address, or ``deadline``.

        A decode sends its notice before it marks itself done, but the notice travels on
        its own socket and is counted by prefill's bootstrap thread whenever it gets there:
        without this wait the result could be written first (seen once in CI, under load).
        """
        mgr = getattr(self, "mgr", None)
        host, port = getattr(mgr, "local_ip", None), getattr(mgr, "rank_port", None)
        if not host or not port:
            return
        expected = sum(_done_file_counts(f).get(f"{host}:{port}", 0.0) for f in done_files)
        while expected and time.monotonic() < deadline:
            if sum(_counter_samples("verify_mismatch_reports_total").values()) >= expected:
                break
            time.sleep(0.05)
        if expected:
            got = sum(_counter_samples("verify_mismatch_reports_total").values())
            self.mark(f"mismatch notices for {host}:{port}: {got:g} of {expected:g} counted")


class _Pool:
    """A pool's buffers as uint8 views of shape (pages, item_bytes), checked against SGLang's pointers."""

    def __init__(self, pool_id, name, tensors, ptrs, lens, item_lens):
        import torch

        if len(tensors) != len(ptrs):
            raise RuntimeError(f"{name}: {len(tensors)} tensors but {len(ptrs)} registered pointers")
        self.pool_id = pool_id
        self.name = name
        self.views = []
        self.item_bytes = []
        pages = set()
        for t, ptr, ln, item in zip(tensors, ptrs, lens, item_lens):
            if t.data_ptr() != ptr or t.nbytes != ln or ln % item:
                raise RuntimeError(f"{name}: tensor/pointer mismatch ({t.data_ptr()} vs {ptr}, {t.nbytes} vs {ln})")
            view = t.view(torch.uint8).reshape(ln // item, item)
            self.views.append(view)
            self.item_bytes.append(int(item))
            pages.add(ln // item)
        if len(pages) != 1:
            raise RuntimeError(f"{name}: buffers disagree on page count: {sorted(pages)}")
        self.num_pages = pages.pop()
        devices = sorted({str(t.device) for t in tensors})
        if len(devices) > 1:
            raise RuntimeError(f"{name}: buffers on several devices: {devices}")
        self.device = devices[0] if devices else None


@functools.lru_cache(maxsize=None)
def _load_hook(env: str):
    """The ``<file.py>:<function>`` hook named by ``$env``, loaded once per process (None when unset)."""
    spec = os.environ.get(env)
    if not spec:
        return None
    import importlib.util

    path, _, func = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"harness_hook_{env.lower()}", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{env}={spec!r}: cannot load {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, func)


def _split(pages: list, n: int) -> List[list]:
    n = max(1, min(n, len(pages))) if pages else 1
    size, extra = divmod(len(pages), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(pages[start:end])
        start = end
    return out


def _wait_peer_result(path: Optional[str], deadline: float, request_done) -> None:
    """Wait until the other side's result file (``path``) lists a request for which
    ``request_done(record)`` holds, or shows an error, or ``deadline`` passes."""
    while path and time.monotonic() < deadline:
        try:
            with open(path) as f:
                peer = json.load(f)
        except (OSError, ValueError):
            peer = {}
        if peer.get("error") or any(request_done(r) for r in peer.get("requests", [])):
            return
        time.sleep(0.02)


def _wait_port(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bootstrap server did not listen on {host}:{port}")
            time.sleep(0.05)


def _wait_ready(paths: List[str], deadline: float, wave: Optional[int] = None) -> None:
    """Wait until every result file in ``paths`` shows a constructed manager (and, with
    ``wave``, that wave finished)."""
    pending = list(paths)
    while pending:
        for path in list(pending):
            try:
                with open(path) as f:
                    res = json.load(f)
            except (OSError, ValueError):
                continue
            if res.get("error"):
                raise RuntimeError(f"peer {path} failed in setup: {str(res['error']).strip().splitlines()[-1]}")
            done = wave is None or any(w.get("wave", -1) >= wave for w in res.get("waves") or [])
            if "manager" in res.get("timings", {}) and done:
                pending.remove(path)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"peers not ready before the startup bound: {pending}")
            time.sleep(0.05)


def _check_cuda(torch, device: str) -> None:
    """GPU pools need a GPU this process can see; say which and why not."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"--device {device}: CUDA is not available in this process (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(f"--device {device}: this process sees {count} GPU(s) (indices 0..{count - 1})")


def _touch(path: Optional[str], counts: Optional[Dict[str, float]] = None) -> None:
    """Mark this rank done: ``{"pid": ..., "counts": {label: value}}``, written whole
    (renamed into place) because other ranks read it the moment it exists."""
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "counts": counts or {}}, f)
        os.replace(tmp, path)


def _counted_file(done_file: str) -> str:
    """Written by a prefill rank once it has counted the mismatch notices sent to it."""
    return f"{done_file}.counted"


def _done_file_counts(path: str) -> Dict[str, float]:
    """The counts a rank wrote into its done file ({} for one that holds none)."""
    try:
        with open(path) as f:
            counts = json.load(f).get("counts", {})
        return {str(k): float(v) for k, v in counts.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _counter_samples(name: str, label: Optional[str] = None) -> Dict[str, float]:
    """This process's values of plugin counter ``name`` (metrics.py), keyed by ``label``'s
    value ("" without a label); {} when the plugin made no metrics here."""
    if "sglang_disagg_ext.metrics" not in sys.modules:
        return {}
    from prometheus_client import REGISTRY

    from sglang_disagg_ext.metrics import PREFIX

    values: Dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == PREFIX + name:
                key = sample.labels.get(label, "") if label else ""
                values[key] = values.get(key, 0.0) + sample.value
    return values


def _print_engine_thread_stacks(why: str) -> None:
    """Print the innermost frames of SGLang's bootstrap/transfer threads to stderr (the log tail).

    A request that never leaves Bootstrapping leaves no error behind; the
    stacks say whether the manager's thread is blocked (and in which call) or
    idle waiting for a message that never came.
    """
    frames = sys._current_frames()
    lines = [f"[harness] {why}; engine thread stacks:"]
    for t in threading.enumerate():
        if t.ident not in frames or t is threading.current_thread() or t.name.startswith("harness-"):
            continue
        stack = traceback.extract_stack(frames[t.ident])[-4:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))
        lines.append(f"  {t.name}: {where}")
    print("\n".join(lines[:16]), file=sys.stderr, flush=True)


def _start_watchdog(max_seconds: Optional[float]) -> None:
    """End this process if the harness parent dies or the lifetime bound passes.

    The parent kills its children on every exit path it controls; this covers
    the ones it does not (the parent itself killed).
    """
    parent = os.getppid()
    end = None if not max_seconds else time.monotonic() + max_seconds

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                print("[harness] parent gone; exiting", file=sys.stderr, flush=True)
                os._exit(3)
            if end is not None and time.monotonic() > end:
                print("[harness] lifetime bound passed; exiting", file=sys.stderr, flush=True)
                os._exit(4)

    threading.Thread(target=watch, name="harness-watchdog", daemon=True).start()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--scenario", required=True, help="scenario JSON file")
    p.add_argument("--backend", required=True, help="transfer backend name, e.g. mooncake or mooncake-ext")
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dist-init", required=True, help="torch.distributed init method (file://...)")
    p.add_argument("--result", required=True)
    p.add_argument("--done-file", required=True, help="this rank's done file, touched when its requests are over")
    p.add_argument("--peer-result", default=None, help="prefill: decode's result file (ends hopeless waits early)")
    p.add_argument("--load-plugin", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--max-seconds", type=float, default=None, help="hard lifetime bound of this process")
    p.add_argument("--tp-rank", type=int, default=0, help="multi-rank scenarios: this process's TP rank")
    p.add_argument("--ready-files", default=None, help="decode: prefill result files to wait for (os.pathsep)")
    p.add_argument("--done-files", default=None, help="every rank's done file (os.pathsep): stay up until all exist")
    p.add_argument("--protocol", default="tcp", help="engine protocol: tcp or rdma (harness.transport)")
    p.add_argument("--device", default="cpu", help="pool device: cpu, cuda or cuda:N")
    p.add_argument("--ib-device", default=None, help="RDMA device(s) for --protocol rdma")
    p.add_argument("--first-wave", type=int, default=0, help="wave runs: start at this wave (a restarted decode)")
    p.add_argument("--mismatched-peer", action="store_true",
                   help="wave runs: the second decode, serving the mismatched-peer requests only")
    p.add_argument("--crash-in-wave", type=int, default=None,
                   help="wave runs, decode: SIGKILL this process in that wave, after half its metadata went out")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    _start_watchdog(args.max_seconds)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = Worker(args)
    logging.getLogger().addHandler(worker.logs)
    # The plugin's own INFO lines (its activation line), as a server at SGLang's
    # default log level shows them.
    plugin_logger = logging.getLogger("sglang_disagg_ext")
    plugin_logger.setLevel(logging.INFO)
    plugin_logger.addHandler(worker.plugin_log)
    for name in filter(None, (n.strip() for n in os.environ.get(DEBUG_LOGGERS_ENV, "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)
    rc = worker.main()
    os._exit(rc)


if __name__ == "__main__":
    main()
