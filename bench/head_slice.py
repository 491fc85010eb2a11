"""Item 3: heterogeneous-TP head-slice descriptor construction, stock vs nixl-ext.

Both sides are the real ``send_kvcache_slice`` of their manager class on the
installed release: stock ``NixlKVManager.send_kvcache_slice`` and the plugin's
``NixlExtKVManager.send_kvcache_slice`` (``core.head_slice`` +
``backends.nixl.conn``), called with identical inputs, and both hand their arrays
to the same real ``nixl_agent.get_xfer_descs`` (NIXL 1.5.1, an agent without
backends: building descriptor lists needs none). What is timed is everything
the method does up to and including the two descriptor lists.

Replaced boundary: a manager needs a started NIXL agent, registered memory and
a decode peer, none of which descriptor construction touches. So each manager
is made with ``object.__new__`` and given only the attributes the method reads
(``kv_args`` fields, pipeline layer bookkeeping for
``get_mha_kv_ptrs_with_pp``, and for ext the state its ``__init__`` sets
before calling stock's), and ``initialize_xfer`` / ``transfer`` (the actual
transfer, not construction) return a handle without moving bytes. The buffer
pointers are plain integers: no memory is read or written.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np

from bench.stats import median, paired_ratios, run_interleaved

VRAM = "VRAM"


@dataclasses.dataclass(frozen=True)
class HeadSliceCase:
    prefill_tp: int
    decode_tp: int
    total_kv_heads: int
    prefill_rank: int
    decode_rank: int
    tokens: int = 32768
    layers: int = 64
    page_size: int = 64
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def name(self) -> str:
        return (f"P{self.prefill_tp}->D{self.decode_tp} H{self.total_kv_heads} "
                f"({self.tokens // 1024}K tok x {self.layers} layers)")

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.dtype_bytes

    def heads_per_rank(self, tp: int) -> int:
        return max(1, self.total_kv_heads // tp)


def default_cases(quick: bool = False) -> List[HeadSliceCase]:
    kw = dict(tokens=2048, layers=4) if quick else {}
    return [
        HeadSliceCase(2, 4, 8, prefill_rank=0, decode_rank=1, **kw),  # one prefill rank feeds two decode ranks
        HeadSliceCase(4, 2, 8, prefill_rank=1, decode_rank=0, **kw),  # two prefill ranks feed one decode rank
    ]


class _RecordingAgent:
    """A real ``nixl_agent`` for descriptor lists; the transfer calls do nothing."""

    def __init__(self, agent):
        self._agent = agent
        self.descs: List[Any] = []

    def get_xfer_descs(self, descs, mem_type=None, *args, **kwargs):
        out = self._agent.get_xfer_descs(descs, mem_type, *args, **kwargs)
        self.descs.append(out)
        return out

    def initialize_xfer(self, *args, **kwargs):
        return "handle"

    def transfer(self, *args, **kwargs):
        return "PROC"

    def send_notif(self, *args, **kwargs):
        return None


def _kv_args(case: HeadSliceCase, base: int) -> SimpleNamespace:
    per_rank = case.heads_per_rank(case.prefill_tp)
    item = case.page_size * per_rank * case.head_bytes
    pages = case.tokens // case.page_size + 1
    ptrs = [base + i * pages * item for i in range(2 * case.layers)]  # K layers then V layers
    return SimpleNamespace(
        engine_rank=case.prefill_rank, pp_rank=0, kv_item_lens=[item] * len(ptrs), kv_data_ptrs=ptrs,
        page_size=case.page_size, total_kv_head_num=case.total_kv_heads, kv_head_num=per_rank, gpu_id=0,
        prefill_start_layer=0,
    )


def _bare_manager(cls, case: HeadSliceCase, agent, ext: bool):
    """A manager object with only what ``send_kvcache_slice`` reads (see module doc)."""
    mgr = object.__new__(cls)
    mgr.kv_args = _kv_args(case, base=0x7F00_0000_0000)
    mgr.pp_size, mgr.pp_rank = 1, 0
    mgr.agent = agent
    if ext:
        from sglang_disagg_ext.backends.nixl.conn import ExtNixlAgent

        # What NixlExtKVManager.__init__ sets before stock's constructor, and
        # what register_buffer_to_engine records: local KV buffers as VRAM, as
        # on a GPU node (and as stock assumes), so both sides build VRAM lists.
        mgr._ext_is_prefill = True
        mgr._ext_pp_rank, mgr._ext_engine_rank = 0, case.prefill_rank
        mgr._ext_layouts, mgr._ext_total_kv_heads = {}, None
        mgr._ext_local_kinds = {p: VRAM for p in mgr.kv_args.kv_data_ptrs}
        mgr._ext_peer_kinds = {}
        mgr.agent = ExtNixlAgent(agent, mgr)
    return mgr


def measure(case: HeadSliceCase, repeats: int) -> Dict[str, Any]:
    from nixl._api import nixl_agent, nixl_agent_config
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    from sglang_disagg_ext.backends.nixl.conn import NixlExtKVManager

    raw_agent = nixl_agent(f"bench-head-slice-{time.monotonic_ns()}", nixl_agent_config(backends=[]))
    agents = {"stock": _RecordingAgent(raw_agent), "ext": _RecordingAgent(raw_agent)}
    mgrs = {
        "stock": _bare_manager(NixlKVManager, case, agents["stock"], ext=False),
        "ext": _bare_manager(NixlExtKVManager, case, agents["ext"], ext=True),
    }
    dst_heads = case.heads_per_rank(case.decode_tp)
    dst_item = case.page_size * dst_heads * case.head_bytes
    n_pages = case.tokens // case.page_size
    rng = np.random.default_rng(0)
    src_pages = (rng.permutation(n_pages) + 1).astype(np.int32)
    dst_pages = (rng.permutation(n_pages) + 1).astype(np.int32)
    dst_ptrs = [0x7E00_0000_0000 + i * (n_pages + 1) * dst_item for i in range(2 * case.layers)]
    args = dict(peer_name="decode", prefill_kv_indices=src_pages, dst_kv_ptrs=dst_ptrs, dst_kv_indices=dst_pages,
                dst_gpu_id=0, notif="1_kv_0_1_0", prefill_tp_size=case.prefill_tp, decode_tp_size=case.decode_tp,
                decode_tp_rank=case.decode_rank, dst_kv_item_len=dst_item)

    def timed(v):
        def run() -> float:
            agents[v].descs.clear()
            t0 = time.perf_counter()
            mgrs[v].send_kvcache_slice(**args)
            return time.perf_counter() - t0
        return run

    samples = run_interleaved({"stock": timed("stock"), "ext": timed("ext")}, repeats=repeats)
    counts = {v: [d.descCount() for d in agents[v].descs] for v in agents}
    if counts["stock"] != counts["ext"]:
        raise RuntimeError(f"{case.name}: stock built {counts['stock']} descriptors, ext {counts['ext']}")
    stock, ext = median(samples["stock"]), median(samples["ext"])
    paired = paired_ratios(samples["ext"], samples["stock"])
    return {
        "case": case.name,
        "stock_s": stock,
        "ext_s": ext,
        "ratio": paired["median"],
        "ratio_q1": paired["q1"],
        "ratio_q3": paired["q3"],
        "descriptors": counts["ext"][0],  # per list (local and remote lists are the same length)
        "repeats": repeats,
        "samples_s": samples,
    }
