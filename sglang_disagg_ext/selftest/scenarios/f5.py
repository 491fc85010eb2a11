"""F5 scenarios (retract/resume aliasing), stock vs ext, on real SGLang classes.

Each scenario builds the real SGLang objects on CPU tensors and drives them
through the real code path:

* ``retract-resume``: a real ``NSATokenToKVPool`` and ``PagedTokenToKVPoolAllocator``;
  request A is retracted with SGLang's own ``Req.offload_kv_cache`` (which calls
  ``allocator.get_cpu_copy(...)`` exactly as the scheduler does), its pages are
  freed and reused and overwritten by other requests, then A is resumed with
  ``Req.load_kv_cache`` into newly allocated pages. After every resume, A's KV
  rows and index-key pages must equal what they were before the retract.
* ``metadata-get-buf``: a real ``MetadataBuffers``; A's buffers are taken with
  ``get_buf``, the slot is reused by B through ``set_buf``, A's data must be
  unchanged.
* ``nsa-clear-buffers``: after ``_clear_buffers`` no index-key tensor of the pool
  is referenced any more.

Stock ``get_cpu_copy``/``load_cpu_copy`` call ``torch.cuda.synchronize()``
unconditionally, which raises on a CPU-only torch. To run *stock* on a CPU pool,
that one call is neutralised (a no-op) for the stock run only; the ext run
neutralises nothing.

What stock does differs per release, and is read from the shape of the
installed stock classes (:func:`stock_f5_shape`), never from a version string:
0.5.10.post1 / 0.5.11 return views from ``get_buf`` and let the NSA pool
inherit an offload and ``_clear_buffers`` that ignore the index keys: all three
scenarios fail. 0.5.12.x clones in ``get_buf`` (disaggregation/utils.py:244)
and releases the index keys (memory_pool.py:2067), but its own NSA offload
``get_cpu_copy(self, indices)`` (:2145) rejects the ``mamba_indices=`` keyword
the allocator passes (allocator.py:524): retract-resume fails with TypeError.

``f5_rows()`` is what ``sglang-disagg-ext selftest`` shows for F5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import time
import types
import weakref
from typing import Callable, Dict, List, Optional

import torch

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.common.retract import retract_fixes

PAGE_SIZE = 64  # NSATokenToKVPool asserts 64 on CUDA/CPU builds (1 on HIP)


# --------------------------------------------------------------------------
# Building real SGLang objects on CPU
# --------------------------------------------------------------------------


def nsa_pool_class():
    return releases.nsa_pool_class()


def build_nsa_pool(layer_num: int = 3, num_pages: int = 16, device: str = "cpu", chunk_tokens: Optional[int] = None,
                   kv_lora_rank: int = 64, qk_rope_head_dim: int = 64):
    """A real index-key pool with ``num_pages`` usable pages of 64 tokens: the class the
    release builds for NSA/DSA models (``releases.index_key_pool_class``: ``NSATokenToKVPool``
    up to 0.5.12.x, ``DSATokenToKVPool`` on 0.5.13+)."""
    cls = releases.index_key_pool_class()
    if cls is None:
        raise LookupError(f"this SGLang release has none of {', '.join(releases.INDEX_KEY_POOL_CLASS_NAMES)}")
    extra = {}
    if "index_buf_size" in releases.init_parameters(cls):
        # Every release's default for one attention rank (0.5.11 memory_pool.py:1905-1906);
        # 0.5.23 would otherwise read the decode-context-parallel width from a parallel
        # config that only a running server publishes.
        extra["index_buf_size"] = num_pages * PAGE_SIZE
    pool = cls(**extra, 
        size=num_pages * PAGE_SIZE,
        page_size=PAGE_SIZE,
        kv_lora_rank=kv_lora_rank,
        dtype=torch.bfloat16,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=layer_num,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_lora_rank + qk_rope_head_dim,
    )
    if chunk_tokens is not None:
        pool.cpu_offloading_chunk_size = chunk_tokens  # the pool's own chunk size
    return pool


def build_allocator(pool, device: str = "cpu"):
    """SGLang's paged allocator over ``pool``; freed pages are reused first (need_sort=False)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(
        size=pool.size, page_size=pool.page_size, dtype=pool.dtype, device=device, kvcache=pool, need_sort=False
    )


@contextlib.contextmanager
def stock_cuda_sync_neutralised(active: bool = True):
    """Make ``torch.cuda.synchronize`` a no-op (stock offload on a CPU pool only)."""
    if not active:
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with ``n`` intra-op threads: these scenarios move kilobytes, where
    thread hand-off costs far more than it saves (20x slower on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _needs_neutralising(device: str) -> bool:
    return torch.device(device).type == "cpu" and not torch.cuda.is_available()


@contextlib.contextmanager
def one_attention_rank():
    """Run a block as on a server with one attention rank and no decode context parallel.

    0.5.13+ pools read ``attn_dcp_size`` from the parallel config a running
    server publishes (0.5.23 memory_pool.py:4926, :5338); here nothing is
    published, so the block states width 1 and rank 0 through SGLang's own
    ``get_parallel().override``. Earlier releases have no such config.
    """
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        yield
        return
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        yield


def ext_installs_f5(policy: Optional[releases.ReleasePolicy] = None) -> bool:
    """Whether an ``-ext`` backend name installs the F5 hooks on this release (as
    ``registration.activate`` does): only where F5 is live and the plugin is active.
    Elsewhere ``-ext`` runs the release's own F5 code, exactly as stock does."""
    policy = policy or releases.current_policy()
    return policy.is_live("F5") and policy.support is releases.Support.ACTIVE


# --------------------------------------------------------------------------
# What stock code does here, from the shape of the installed stock classes
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StockF5Shape(releases.StockF5Facts):
    """The release's stock F5 facts (``releases.read_stock_f5``) and what they predict per row."""

    def retract_stock(self, path: str = "scheduler") -> str:
        """"pass" or "fail": stock retract-resume through ``path`` ("scheduler" or "pool")."""
        if not self.nsa_offloads_index_k:
            return "fail"  # index keys stay on the device and are overwritten
        if path == "scheduler" and self.allocator_passes_mamba_indices and not self.nsa_offload_takes_mamba_indices:
            return "fail"  # TypeError from the release's own call convention
        return "pass"

    def metadata_stock(self) -> str:
        return "pass" if self.get_buf_copies else "fail"

    def clear_stock(self) -> str:
        return "pass" if self.nsa_clear_releases_index_k else "fail"


def stock_f5_shape() -> StockF5Shape:
    """:class:`StockF5Shape` of the installed release, read by ``releases.read_stock_f5`` (stock methods)."""
    return StockF5Shape(**dataclasses.asdict(releases.read_stock_f5()))


# --------------------------------------------------------------------------
# Scenario: retract -> reuse -> resume
# --------------------------------------------------------------------------


def req_retract_methods():
    """SGLang's own ``Req.offload_kv_cache`` / ``Req.load_kv_cache`` and where they came from.

    Normally the methods of the imported ``Req`` class. Where ``schedule_batch``
    cannot be imported on a CPU machine (0.5.10.post1 imports ``sgl_kernel`` at
    module level through ``memory_pool_host``; this project's test environments
    carry an import-only stand-in for it, a plain CPU install does not), the two methods are compiled
    from that release's ``schedule_batch.py`` source, unchanged: they use
    nothing but their arguments.
    """
    try:
        from sglang.srt.managers.schedule_batch import Req
    except ImportError as exc:
        import ast
        import importlib.util

        spec = importlib.util.find_spec("sglang.srt.managers.schedule_batch")
        source = open(spec.origin, encoding="utf-8").read()
        tree = ast.parse(source)
        wanted = {"offload_kv_cache", "load_kv_cache"}
        defs = [
            node
            for cls in tree.body
            if isinstance(cls, ast.ClassDef) and cls.name == "Req"
            for node in cls.body
            if isinstance(node, ast.FunctionDef) and node.name in wanted
        ]
        if {d.name for d in defs} != wanted:
            raise LookupError(f"Req.offload_kv_cache/load_kv_cache not found in {spec.origin}") from exc
        for d in defs:
            d.decorator_list = []
        namespace: Dict[str, object] = {}
        module = ast.Module(body=defs, type_ignores=[])
        exec(compile(module, spec.origin, "exec"), namespace)
        origin = f"Req methods compiled from {spec.origin} ({type(exc).__name__} importing it: {exc})"
        return namespace["offload_kv_cache"], namespace["load_kv_cache"], origin
    return Req.offload_kv_cache, Req.load_kv_cache, "Req methods"


@dataclasses.dataclass
class RetractReport:
    cycles: int = 0
    kv_mismatch_cycles: int = 0  # the resumed request's KV rows differ from what was offloaded
    index_k_mismatch_cycles: int = 0  # ... its index-key pages differ from what was offloaded
    # Any other byte of the pool (other requests' pages, free pages, the rest of the
    # resumed request's last page, page 0) changed by the offload or the resume.
    other_page_mismatch_cycles: int = 0
    error: Optional[str] = None
    first_failure: Optional[str] = None

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.cycles > 0
            and self.kv_mismatch_cycles == 0
            and self.index_k_mismatch_cycles == 0
            and self.other_page_mismatch_cycles == 0
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class _RandomBytes:
    """Random bytes without generating new ones per write: windows into one random block."""

    def __init__(self, gen: torch.Generator, size: int = 1 << 20):
        self.gen = gen
        self.block = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)

    def take(self, shape, dtype=torch.uint8) -> torch.Tensor:
        width = torch.empty((), dtype=dtype).element_size()
        n = width
        for d in shape:
            n *= d
        if n > len(self.block):
            return torch.randint(0, 256, (n,), generator=self.gen, dtype=torch.uint8).view(dtype).view(*shape)
        start = int(torch.randint(0, (len(self.block) - n) // width + 1, (1,), generator=self.gen)) * width
        return self.block[start : start + n].view(dtype).view(*shape)


def _fill_random(pool, token_indices: torch.Tensor, rnd: _RandomBytes) -> None:
    """Write random bytes into the KV rows and index-key pages of these tokens (all layers)."""
    rows = token_indices.long()
    pages = rows[:: pool.page_size] // pool.page_size
    for layer in range(pool.layer_num):
        # Rows written as int64 words: the same bytes, far fewer elements to index. The random
        # bytes live on the host; a GPU pool takes them over (index_copy_ needs one device).
        kv = pool.kv_buffer[layer].view(torch.uint8).view(torch.int64)
        kv.index_copy_(0, rows, rnd.take((len(rows),) + tuple(kv.shape[1:]), torch.int64).to(kv.device))
        ik = pool.index_k_with_scale_buffer[layer].view(torch.int64)
        ik.index_copy_(0, pages, rnd.take((len(pages),) + tuple(ik.shape[1:]), torch.int64).to(ik.device))


def _snapshot(pool, token_indices: torch.Tensor, n_tokens: int):
    """Bytes of the first ``n_tokens`` KV rows and of their index-key pages, per layer."""
    rows = token_indices[:n_tokens].long()
    pages = rows[:: pool.page_size] // pool.page_size
    kv = [pool.kv_buffer[l].view(torch.uint8).index_select(0, rows) for l in range(pool.layer_num)]
    ik = [pool.index_k_with_scale_buffer[l].index_select(0, pages) for l in range(pool.layer_num)]
    return kv, ik


def _whole_pool(pool):
    """Every byte of the pool, per layer: the KV buffer (one row per token slot) and the
    index-key buffer (one row per page), as uint8 clones."""
    kv = [pool.kv_buffer[l].view(torch.uint8).reshape(pool.kv_buffer[l].shape[0], -1).clone() for l in range(pool.layer_num)]
    ik = [pool.index_k_with_scale_buffer[l].view(torch.uint8).clone() for l in range(pool.layer_num)]
    return kv, ik


def _rows_changed(before, after) -> set:
    """Row numbers (any layer) where ``after`` differs from ``before``."""
    out = set()
    for a, b in zip(before, after):
        out.update(torch.nonzero((a != b).reshape(a.shape[0], -1).any(dim=1)).flatten().tolist())
    return out


def _retracted_request(n_tokens: int):
    """The fields SGLang's ``Req.offload_kv_cache``/``load_kv_cache`` read, for request A in
    pool row 0: flat (0.5.10.post1 - 0.5.12.x) and under ``req.kv`` (0.5.13+), with the
    release's own ``Req._mamba_pool_needing_backup`` bound where it has one."""
    kv = types.SimpleNamespace(req_pool_idx=0, mamba_pool_idx=None, retraction_backup=None, holds_mamba=False)
    req = types.SimpleNamespace(req_pool_idx=0, seqlen=n_tokens + 1, mamba_pool_idx=None, kv=kv)
    try:
        from sglang.srt.managers.schedule_batch import Req
    except ImportError:  # 0.5.10.post1 on CPU: its methods use no helper (req_retract_methods)
        return req
    helper = getattr(Req, "_mamba_pool_needing_backup", None)
    if helper is not None:
        req._mamba_pool_needing_backup = types.MethodType(helper, req)
    return req


def _pool_path_methods():
    """Offload/restore by calling the pool directly, positional ``(indices)`` as upstream's own code does."""

    def offload_kv_cache(req, req_to_token_pool, allocator):
        indices = req_to_token_pool.req_to_token[req.req_pool_idx, : req.seqlen - 1]
        req.kv_cache_cpu = allocator.get_kvcache().get_cpu_copy(indices)

    def load_kv_cache(req, req_to_token_pool, allocator):
        indices = req_to_token_pool.req_to_token[req.req_pool_idx, : req.seqlen - 1]
        allocator.get_kvcache().load_cpu_copy(req.kv_cache_cpu, indices)
        del req.kv_cache_cpu

    return offload_kv_cache, load_kv_cache


def run_retract_cycles(pool, allocator, cycles: int, seed: int = 0, path: str = "scheduler", max_pages_a: int = 4,
                       max_pages_other: int = 4, max_others: int = 3) -> RetractReport:
    """Retract request A, let others reuse its pages, resume A; check A's bytes each cycle.

    ``path="scheduler"`` retracts and resumes through SGLang's ``Req`` methods and
    the allocator (the call convention the scheduler uses); ``path="pool"`` calls
    the pool's ``get_cpu_copy(indices)`` / ``load_cpu_copy(copy, indices)`` directly.
    """
    if path == "scheduler":
        offload_kv_cache, load_kv_cache, _ = req_retract_methods()
    elif path == "pool":
        offload_kv_cache, load_kv_cache = _pool_path_methods()
    else:
        raise ValueError(f"path must be 'scheduler' or 'pool', not {path!r}")

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rnd = _RandomBytes(gen)
    max_tokens = max_pages_a * pool.page_size
    # On the pool's device, as SGLang's ReqToTokenPool is: the offload gets device indices.
    req_to_token_pool = types.SimpleNamespace(
        req_to_token=torch.zeros((1, max_tokens), dtype=torch.int32, device=pool.kv_buffer[0].device))
    report = RetractReport()
    for cycle in range(cycles):
        n_pages_a = rng.randint(1, max_pages_a)
        n_tokens = rng.randint((n_pages_a - 1) * pool.page_size + 1, n_pages_a * pool.page_size)
        # Req.offload_kv_cache offloads req_to_token[req_pool_idx, : seqlen - 1].
        req_a = _retracted_request(n_tokens)
        slots = allocator.alloc(n_pages_a * pool.page_size)
        if slots is None:
            report.error = f"cycle {cycle}: allocator out of pages for A"
            return report
        req_to_token_pool.req_to_token[0, : len(slots)] = slots.to(torch.int32)
        _fill_random(pool, slots, rnd)
        want_kv, want_ik = _snapshot(pool, slots, n_tokens)

        # Retract A: SGLang's own offload path, then its pages go back to the allocator.
        before_offload = _whole_pool(pool)
        offload_kv_cache(req_a, req_to_token_pool, allocator)
        after_offload = _whole_pool(pool)
        offload_wrote = _rows_changed(before_offload[0], after_offload[0]) | _rows_changed(
            before_offload[1], after_offload[1]
        )
        del before_offload, after_offload
        allocator.free(slots)
        if rng.random() < 0.5:  # fragment the free list
            perm = torch.randperm(len(allocator.free_pages), generator=gen)
            allocator.free_pages = allocator.free_pages[perm]

        # Other requests reuse (and overwrite) the freed pages.
        others = []
        for _ in range(rng.randint(1, max_others)):
            got = allocator.alloc(rng.randint(1, max_pages_other) * pool.page_size)
            if got is None:
                break
            _fill_random(pool, got, rnd)
            others.append(got)
        # Some of them finish before A resumes, some are still running.
        rng.shuffle(others)
        n_finished = rng.randint(0, len(others))
        for got in others[:n_finished]:
            allocator.free(got)
        others = others[n_finished:]

        new_slots = allocator.alloc(n_pages_a * pool.page_size)
        while new_slots is None and others:
            allocator.free(others.pop())
            new_slots = allocator.alloc(n_pages_a * pool.page_size)
        if new_slots is None:
            report.error = f"cycle {cycle}: allocator out of pages for resume"
            return report
        req_to_token_pool.req_to_token[0, : len(new_slots)] = new_slots.to(torch.int32)
        # What every byte of the pool must hold after the resume: what it holds now (other
        # requests' pages, free pages, the tail of A's last page), except A's first
        # n_tokens KV rows and A's index-key pages, which must hold what was offloaded.
        want_kv_pool, want_ik_pool = _whole_pool(pool)
        a_rows = new_slots[:n_tokens].long()
        a_pages = a_rows[:: pool.page_size] // pool.page_size
        for layer in range(pool.layer_num):
            want_kv_pool[layer][a_rows] = want_kv[layer].reshape(len(a_rows), -1)
            want_ik_pool[layer][a_pages] = want_ik[layer].view(torch.uint8).reshape(len(a_pages), -1)
        load_kv_cache(req_a, req_to_token_pool, allocator)

        got_kv_pool, got_ik_pool = _whole_pool(pool)
        kv_rows = _rows_changed(want_kv_pool, got_kv_pool)
        ik_rows = _rows_changed(want_ik_pool, got_ik_pool)
        del want_kv_pool, want_ik_pool, got_kv_pool, got_ik_pool
        a_row_set, a_page_set = set(a_rows.tolist()), set(a_pages.tolist())
        kv_ok = not (kv_rows & a_row_set)
        ik_ok = not (ik_rows & a_page_set)
        others_ok = not offload_wrote and not (kv_rows - a_row_set) and not (ik_rows - a_page_set)
        report.cycles += 1
        if not kv_ok:
            report.kv_mismatch_cycles += 1
        if not ik_ok:
            report.index_k_mismatch_cycles += 1
        if not others_ok:
            report.other_page_mismatch_cycles += 1
        if (not kv_ok or not ik_ok or not others_ok) and report.first_failure is None:
            report.first_failure = (
                f"cycle {cycle}: {n_tokens} tokens on {n_pages_a} pages; "
                f"kv {'ok' if kv_ok else 'CHANGED'}, index_k {'ok' if ik_ok else 'CHANGED'}, "
                f"rest of the pool {'ok' if others_ok else 'CHANGED'}"
                + (
                    ""
                    if others_ok
                    else f" (offload wrote rows {sorted(offload_wrote)[:8]}; resume changed kv rows "
                    f"{sorted(kv_rows - a_row_set)[:8]}, index-key pages {sorted(ik_rows - a_page_set)[:8]})"
                )
            )
        allocator.free(new_slots)
        for got in others:
            allocator.free(got)
    return report


def retract_scenario(ext: bool, cycles: int = 100, seed: int = 0, device: str = "cpu", layer_num: int = 3,
                     num_pages: int = 16, chunk_tokens: Optional[int] = None, path: str = "scheduler") -> RetractReport:
    """Build a fresh pool and run the cycles with the fix installed (``ext``) or stock."""
    with one_attention_rank():
        return _retract_scenario(ext, cycles, seed, device, layer_num, num_pages, chunk_tokens, path)


def _retract_scenario(ext, cycles, seed, device, layer_num, num_pages, chunk_tokens, path) -> RetractReport:
    pool = build_nsa_pool(layer_num=layer_num, num_pages=num_pages, device=device, chunk_tokens=chunk_tokens)
    allocator = build_allocator(pool, device)
    # ext: what the -ext name runs here (the plugin's hooks where F5 is live, else the
    # release's own code, which needs the same CPU stand-in as stock).
    hooks = ext and ext_installs_f5()
    neutralise = (not hooks) and _needs_neutralising(device)
    with retract_fixes(enabled=hooks), stock_cuda_sync_neutralised(neutralise), torch_threads(1):
        try:
            return run_retract_cycles(pool, allocator, cycles, seed=seed, path=path)
        except Exception as e:  # a crash on the retract path is a failure, reported as such
            return RetractReport(error=f"{type(e).__name__}: {e}")


def stock_retract_signature(report: RetractReport, shape, path: str = "scheduler") -> Optional[str]:
    """None when a stock ``report`` of :func:`retract_scenario` shows exactly the live F5 bug
    of this release (``shape``: :func:`stock_f5_shape`), else why it does not.

    * The offload ignores the index keys (0.5.10.post1, 0.5.11; 0.5.12.x through the pool):
      every cycle completes, the resumed request's KV rows come back, its index-key pages
      hold what other requests wrote there, and nothing else in the pool changed.
    * 0.5.12.x through the scheduler: the very first retract raises TypeError because the
      allocator passes ``mamba_indices=`` to the NSA ``get_cpu_copy(self, indices)``.

    Any other error (the rig out of pages, an import, an unrelated exception) is not it.
    """
    if shape.retract_stock(path) != "fail":
        return f"stock is not expected to fail the {path} path here"
    if (
        path == "scheduler"
        and shape.nsa_offloads_index_k
        and shape.allocator_passes_mamba_indices
        and not shape.nsa_offload_takes_mamba_indices
    ):
        err = report.error or ""
        if report.cycles != 0 or not err.startswith("TypeError") or "mamba_indices" not in err or "get_cpu_copy" not in err:
            return f"expected TypeError from get_cpu_copy naming mamba_indices on the first retract; got {report}"
        return None
    if report.error is not None:
        return f"stock crashed ({report.error}); the live bug raises nothing, it loses the index keys"
    if report.cycles == 0:
        return "no retract/resume cycle ran"
    if report.index_k_mismatch_cycles == 0:
        return "the resumed request's index-key pages came back as offloaded"
    if report.kv_mismatch_cycles:
        return f"KV rows changed in {report.kv_mismatch_cycles} cycles: the live bug keeps KV"
    if report.other_page_mismatch_cycles:
        return f"pages outside the resumed request changed in {report.other_page_mismatch_cycles} cycles"
    return None


# --------------------------------------------------------------------------
# Scenario: MetadataBuffers.get_buf
# --------------------------------------------------------------------------


def _meta_req(slot: int, value: int, hidden_size: int, room: int):
    """What ``MetadataBuffers.set_buf`` reads from a ``Req`` (0.5.10.post1 - 0.5.23 field names)."""
    logprob = types.SimpleNamespace(
        output_token_logprobs_val=[-0.5 * value],
        output_token_logprobs_idx=[value],
        output_top_logprobs_val=[[-0.25 * value, -0.75 * value]],
        output_top_logprobs_idx=[[value, value + 1]],
    )
    return types.SimpleNamespace(
        metadata_buffer_index=slot,
        output_ids=[value],
        cached_tokens=value + 1,
        cached_tokens_device=value + 2,
        cached_tokens_host=value + 3,
        cached_tokens_storage=value + 4,
        return_logprob=True,
        logprob=logprob,  # 0.5.13+ keeps the logprob fields here
        **vars(logprob),  # ... earlier releases on the request itself
        return_sampling_mask=False,
        get_mm_token_counts=lambda: (0, 0, 0),
        multimodal_inputs=None,  # 0.5.18 set_buf reads the inputs themselves (no images: 0 counts)
        hidden_states_tensor=torch.full((hidden_size,), float(value)),
        output_topk_p=torch.full((4,), 0.125 * value),
        output_topk_index=torch.arange(4, dtype=torch.int64) + value,
        output_dsa_topk_indices=None,
        bootstrap_room=room,
    )


def _build_metadata_buffers(hidden_size: int):
    from sglang.srt.disaggregation.utils import MetadataBuffers

    kwargs = dict(size=4, hidden_size=hidden_size, hidden_states_dtype=torch.float32)
    if releases.features().metadata_buffers_sampling_mask:
        kwargs["max_sampling_mask_tokens"] = 16  # 0.5.13+; unused with sampling masks off
    return MetadataBuffers(**kwargs)


@dataclasses.dataclass
class MetadataReport:
    own_data_read: bool = False  # A's get_buf showed what A's set_buf wrote
    unchanged_after_reuse: bool = False  # ... and still does after B reused the slot
    error: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.own_data_read and self.unchanged_after_reuse


def metadata_scenario(ext: bool, slot: int = 2, hidden_size: int = 24) -> MetadataReport:
    report = MetadataReport()
    with retract_fixes(enabled=ext):
        try:
            buffers = _build_metadata_buffers(hidden_size)
            buffers.set_buf(_meta_req(slot, 7, hidden_size, room=1001))
            taken = [t for t in buffers.get_buf(slot) if t is not None]  # held until the request resumes
            hidden = [t for t in taken if t.shape == (hidden_size,) and t.is_floating_point()]
            report.own_data_read = (
                int(taken[0][0]) == 7 and int(taken[-1][0]) == 1001 and len(hidden) == 1 and bool((hidden[0] == 7.0).all())
            )
            before = [t.clone() for t in taken]
            buffers.set_buf(_meta_req(slot, 42, hidden_size, room=2002))  # slot reused by B
            report.unchanged_after_reuse = all(torch.equal(a, b) for a, b in zip(before, taken))
        except Exception as e:
            report.error = f"{type(e).__name__}: {e}"
    return report


# --------------------------------------------------------------------------
# Scenario: NSA _clear_buffers
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ClearReport:
    index_k_alive: int = -1
    kv_alive: int = -1
    error: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.index_k_alive == 0 and self.kv_alive == 0


def clear_buffers_scenario(ext: bool, device: str = "cpu") -> ClearReport:
    report = ClearReport()
    with retract_fixes(enabled=ext):
        try:
            pool = build_nsa_pool(layer_num=3, num_pages=2, device=device)
            ik_refs = [weakref.ref(t) for t in pool.index_k_with_scale_buffer]
            kv_refs = [weakref.ref(t) for t in pool.kv_buffer]
            pool._clear_buffers()
            if any(r() is not None for r in ik_refs + kv_refs):
                gc.collect()  # only a reference cycle could still hold them
            report.index_k_alive = sum(r() is not None for r in ik_refs)
            report.kv_alive = sum(r() is not None for r in kv_refs)
            del pool
        except LookupError:
            raise
        except Exception as e:
            report.error = f"{type(e).__name__}: {e}"
    return report


# --------------------------------------------------------------------------
# Rows for `sglang-disagg-ext selftest`
# --------------------------------------------------------------------------


def _word(passed: Optional[bool]) -> str:
    return "n/a" if passed is None else ("pass" if passed else "fail")


def _row(scenario: str, run: Callable[[bool], object], policy, stock_expected: str,
         signature: Optional[Callable[[object], Optional[str]]] = None) -> Dict:
    """Run ``scenario`` stock and ext; where F5 is upstream, stock is "n/a" and ext is the release's own code.

    Where F5 is live, ``verified`` means ext passed and stock did what the
    shape of its code says (``stock_expected``): "fail" where that part of F5
    is live, "pass" for the parts 0.5.12.x already fixed. Where ``signature`` is
    given and stock must fail, stock must also fail *as the live bug does*
    (``signature(stock_report)`` is None), never through a crash of the rig.
    """
    t0 = time.perf_counter()
    live = policy.is_live("F5")
    notes: List[str] = []
    stock = ext = None
    try:
        if live:
            s, e = run(False), run(True)
            stock, ext = s.passed, e.passed
            if signature is not None and stock_expected == "fail":
                not_the_bug = signature(s)
                if not_the_bug:
                    notes.append(f"stock failure is not the live bug: {not_the_bug}")
                    stock = None  # verified stays False; the row says why
            for label, r in (("stock", s), ("ext", e)):
                detail = getattr(r, "error", None) or getattr(r, "first_failure", None)
                if detail:
                    notes.append(f"{label}: {detail}")
        else:
            # The plugin installs nothing here: what users get is the release's code.
            e = run(False)
            ext = e.passed
            detail = getattr(e, "error", None) or getattr(e, "first_failure", None)
            if detail:
                notes.append(f"release code: {detail}")
    except LookupError as exc:  # the class does not exist in this release
        notes.append(str(exc))
        stock = ext = None
    if live:
        verified = ext is True and stock is not None and _word(stock) == stock_expected
    else:
        verified = ext is True
    from sglang_disagg_ext.selftest.rows import make_row

    return make_row(
        scenario, "F5", "all", _word(stock) if live else "n/a", _word(ext), verified, time.perf_counter() - t0,
        stock_expected=stock_expected if live else "n/a", note="; ".join(notes),
    )


def f5_row_names(cycles: int = 100) -> List[str]:
    """The scenario names of ``f5_rows``, in order."""
    return [
        f"retract-resume NSA kv+index_k ({cycles} cycles)",
        "metadata get_buf isolated from slot reuse",
        "NSA _clear_buffers releases index_k",
    ]


def f5_rows(cycles: int = 100, seed: int = 0, device: str = "cpu", names: Optional[List[str]] = None) -> List[Dict]:
    """F5 rows for the selftest table: each scenario run stock and ext in this process.

    ``names`` limits the rows; one not asked for is neither run nor reported."""
    policy = releases.current_policy()
    try:  # import SGLang's modules up front, so no row's seconds include them
        nsa_pool_class()
        req_retract_methods()
        from sglang.srt.disaggregation import utils  # noqa: F401
    except Exception:
        pass  # the rows report what is missing
    retract_name, metadata_name, clear_name = f5_row_names(cycles)
    shape = None
    try:
        shape = stock_f5_shape()
        expect = (shape.retract_stock("scheduler"), shape.metadata_stock(), shape.clear_stock())
    except Exception as exc:  # noqa: BLE001 - the rows then say why nothing could be predicted
        shape = None
        expect = (f"unknown ({type(exc).__name__}: {exc})",) * 3
    retract_signature = (lambda report: stock_retract_signature(report, shape)) if shape is not None else None
    cases = (
        (retract_name, lambda ext: retract_scenario(ext, cycles=cycles, seed=seed, device=device), expect[0],
         retract_signature),
        (metadata_name, lambda ext: metadata_scenario(ext), expect[1], None),
        (clear_name, lambda ext: clear_buffers_scenario(ext, device=device), expect[2], None),
    )
    return [_row(name, run, policy, expected, signature=signature)
            for name, run, expected, signature in cases if names is None or name in names]
