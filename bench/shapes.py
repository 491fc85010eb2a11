"""Benchmark shapes and page lists. Pure: no SGLang, no torch.

The transfer benchmark (items 1 and 2) runs real SGLang managers over a real
Mooncake engine on loopback TCP with CPU pools. To reach 128K tokens per
request on a small shared machine the model is scaled down in bytes per token,
not in tokens or pages:

* page size 64 tokens (a common SGLang setting);
* KV: 4 layers x (K, V) x 1 head x 64 dims, bfloat16: 8 buffers, 8 KiB per page
  per buffer, 1 KiB per token (a 7-8B model has ~128 KiB per token);
* state component ``swa``: 2 layers x (K, V) of the same row size, sliding
  window of 2048 tokens (32 pages);
* state component ``nsa``: 1 layer x (K, V) x 1 head x 16 dims (index keys are
  small), every page of the request;
* pages are allocated fragmented, as a busy radix cache hands them out: runs of
  1..8 consecutive pages in shuffled order, independently on prefill and
  decode. SGLang coalesces a run only where both sides are consecutive, so the
  engine sees about one descriptor per page run and buffer.

The number of descriptors per request is what Python-side overhead scales
with; the bytes are what the engine moves.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Optional, Sequence, Tuple

PAGE_SIZE = 64
KV_LAYERS = 4
KV_HEADS = 1
KV_HEAD_DIM = 64
DTYPE = "bfloat16"
DTYPE_BYTES = 2
SWA_LAYERS = 2
SWA_WINDOW_TOKENS = 2048
NSA_LAYERS = 1
NSA_HEAD_DIM = 16
MAX_RUN_PAGES = 8


@dataclasses.dataclass(frozen=True)
class StateComponentShape:
    kind: str  # "swa" or "nsa"
    layers: int
    head_dim: int
    window_tokens: Optional[int]  # None: every page of the request

    def pages_for(self, tokens: int, page_size: int = PAGE_SIZE) -> int:
        pages = pages_for_tokens(tokens, page_size)
        if self.window_tokens is None:
            return pages
        return min(pages, pages_for_tokens(self.window_tokens, page_size))

    def page_bytes(self, page_size: int = PAGE_SIZE) -> int:
        """Bytes of one page over all of this component's buffers (K and V)."""
        return 2 * self.layers * page_size * KV_HEADS * self.head_dim * DTYPE_BYTES


SWA = StateComponentShape("swa", SWA_LAYERS, KV_HEAD_DIM, SWA_WINDOW_TOKENS)
NSA = StateComponentShape("nsa", NSA_LAYERS, NSA_HEAD_DIM, None)


def state_components(per_component_layout: bool) -> Tuple[StateComponentShape, ...]:
    """Two components where the release carries a list of them (0.5.12+), one
    (``swa``) on the flat layout of 0.5.10.post1 / 0.5.11, which has a single
    ``state_type``."""
    return (SWA, NSA) if per_component_layout else (SWA,)


def pages_for_tokens(tokens: int, page_size: int = PAGE_SIZE) -> int:
    if tokens < 1 or page_size < 1:
        raise ValueError(f"tokens and page_size must be >= 1, got {tokens}, {page_size}")
    return -(-tokens // page_size)


def kv_page_bytes(page_size: int = PAGE_SIZE) -> int:
    """Bytes of one KV page over all KV buffers."""
    return 2 * KV_LAYERS * page_size * KV_HEADS * KV_HEAD_DIM * DTYPE_BYTES


@dataclasses.dataclass(frozen=True)
class TransferCase:
    """One item-1 point: ``concurrency`` requests of ``tokens`` tokens sent at once."""

    tokens: int
    concurrency: int
    with_state: bool

    @property
    def name(self) -> str:
        what = "kv+state" if self.with_state else "kv"
        return f"{what} {_k(self.tokens)} tok x{self.concurrency}"

    def kv_pages(self, page_size: int = PAGE_SIZE) -> int:
        return pages_for_tokens(self.tokens, page_size)


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which item-1 cases to run and how often."""

    token_sweep: Tuple[int, ...]  # at concurrency 1
    concurrency_sweep: Tuple[int, ...]  # at concurrency_tokens
    concurrency_tokens: int
    repeats: int
    goodput_pages: Tuple[int, ...]
    goodput_repeats: int
    cpu_repeats: int = 3  # traced pairs per case (CPU time of the send path, engine calls)

    def cases(self) -> List[TransferCase]:
        out = []
        for with_state in (False, True):
            seen = set()
            for t in self.token_sweep:
                seen.add((t, 1))
                out.append(TransferCase(t, 1, with_state))
            for c in self.concurrency_sweep:
                if (self.concurrency_tokens, c) not in seen:
                    seen.add((self.concurrency_tokens, c))
                    out.append(TransferCase(self.concurrency_tokens, c, with_state))
        return out

    def verify_cases(self) -> List[TransferCase]:
        """Item 8 (verified/unverified): the one-request cases at 8K tokens, where the
        issue's 1.10 target is judged (KV only, and KV with state)."""
        return [c for c in self.cases() if c.tokens == 8192 and c.concurrency == 1]

    def pool_pages(self, page_size: int = PAGE_SIZE) -> Dict[str, int]:
        """Pages each pool needs (page 0 is SGLang's padding page, never handed out)."""
        kv = max(c.concurrency * c.kv_pages(page_size) for c in self.cases())
        need = {"kv": kv}
        for comp in (SWA, NSA):
            need[comp.kind] = max(
                [c.concurrency * comp.pages_for(c.tokens, page_size) for c in self.cases()]
                + list(self.goodput_pages)
            )
        return {k: v + 1 for k, v in need.items()}


FULL = Plan(
    token_sweep=(1024, 2048, 8192, 32768, 131072),
    concurrency_sweep=(1, 4, 16, 64),
    concurrency_tokens=2048,
    repeats=31,  # wall-clock pairs per case: quartiles from 31 ratios
    goodput_pages=(32, 256, 2048),
    goodput_repeats=11,
    cpu_repeats=11,
)

QUICK = Plan(
    token_sweep=(1024, 8192),  # 8K: where the added-CPU target is judged
    concurrency_sweep=(1, 4),
    concurrency_tokens=1024,
    repeats=3,  # a smoke run: every item and key exercised, no figure to read
    goodput_pages=(16,),
    goodput_repeats=2,
    cpu_repeats=2,
)


def fragmented_pages(count: int, pool_pages: int, seed: int, max_run: int = MAX_RUN_PAGES) -> List[int]:
    """``count`` distinct pages from ``1 .. pool_pages - 1``, handed out as a
    busy allocator does: runs of 1..``max_run`` consecutive pages, runs in
    shuffled order. Deterministic in ``seed``."""
    usable = pool_pages - 1
    if count < 0 or count > usable:
        raise ValueError(f"cannot hand out {count} pages from a pool of {pool_pages} (page 0 is reserved)")
    if max_run < 1:
        raise ValueError(f"max_run must be >= 1, got {max_run}")
    rng = random.Random(seed)
    runs, start = [], 1
    while start <= usable:
        n = min(rng.randint(1, max_run), usable - start + 1)
        runs.append(range(start, start + n))
        start += n
    rng.shuffle(runs)
    out: List[int] = []
    for run in runs:
        out.extend(run)
        if len(out) >= count:
            break
    return out[:count]


def split_even(pages: Sequence[int], parts: int) -> List[List[int]]:
    """``pages`` cut into ``parts`` consecutive slices of equal length."""
    if parts < 1 or len(pages) % parts:
        raise ValueError(f"{len(pages)} pages do not split into {parts} equal parts")
    n = len(pages) // parts
    return [list(pages[i * n:(i + 1) * n]) for i in range(parts)]


def batch_pages(case: TransferCase, pool: Dict[str, int], components: Sequence[StateComponentShape],
                page_size: int = PAGE_SIZE) -> Dict[str, object]:
    """Page lists for one batch of ``case``: per request, prefill and decode pages
    of KV and of each state component (fragmented, disjoint across requests)."""
    c = case.concurrency
    seed = case.tokens * 131 + c * 7 + (1 if case.with_state else 0)
    kv_n = case.kv_pages(page_size)
    out: Dict[str, object] = {
        "src_kv": split_even(fragmented_pages(c * kv_n, pool["kv"], seed), c),
        "dst_kv": split_even(fragmented_pages(c * kv_n, pool["kv"], seed + 1), c),
        "src_state": [[] for _ in range(c)],
        "dst_state": [[] for _ in range(c)],
        "aux": list(range(c)),
    }
    if case.with_state:
        for k, comp in enumerate(components):
            n = comp.pages_for(case.tokens, page_size)
            src = split_even(fragmented_pages(c * n, pool[comp.kind], seed + 10 + k), c)
            dst = split_even(fragmented_pages(c * n, pool[comp.kind], seed + 20 + k), c)
            for r in range(c):
                out["src_state"][r].append(src[r])
                out["dst_state"][r].append(dst[r])
    return out


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> int:
    """Runs where both the prefill and the decode page advance by one: how many
    descriptors per buffer SGLang's ``group_concurrent_contiguous`` makes."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} prefill pages vs {len(dst)} decode pages")
    if not src:
        return 0
    runs = 1
    for i in range(1, len(src)):
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs
