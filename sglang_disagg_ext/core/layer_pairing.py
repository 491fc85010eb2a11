"""Pair a paged state component's prefill buffers with decode's by layer (F7). No SGLang import.

A paged state component (SWA, NSA/DSA, DSv4 on a non-MLA backend) is one
``MHATokenToKVPool``: its buffer list is the K buffer of every layer, then
the V buffer of every layer (``get_contiguous_buf_infos``). Both sides build
it from the same model's layer list, in model order, starting at the pool's
local layer 0; a decode running MTP/nextn appends its draft layers, whose
model ids come after every target layer, at the tail. So, on one pipeline
stage, buffer ``e`` of a side with ``n`` layers is layer ``e mod n`` (K for
``e < n``, V otherwise) on both sides, and prefill layer ``L`` belongs in
decode layer ``L``; a decode-only layer receives nothing.

Stock SGLang (``get_mha_kv_ptrs_with_pp``, every release 0.5.10.post1 to
0.5.23) instead guesses from ``len(dst) % len(src)`` that decode holds a
second model's buffers appended after its own V buffers, and then pairs
prefill's V buffers with decode's draft K buffers and the wrong V buffers.

Where the layers cannot be known this way the pairing is refused: with
pipeline parallelism on prefill (each stage's state pool starts again at
local layer 0, and SGLang publishes no state layer ids for these
components, so which decode layers a stage holds is unknown) when the counts
differ; when decode has fewer layers than prefill; when a side's buffer
count is odd (not K/V halves).
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple


class LayerPairingError(ValueError):
    """A state component's prefill and decode buffers cannot be paired by layer."""


@dataclasses.dataclass(frozen=True)
class LayerPairs:
    """Per prefill layer (0 .. n-1, this side's order), the decode layer it goes to."""

    src_layers: int
    dst_layers: int
    dst_of: Tuple[int, ...]

    def split(self, src: Sequence, dst: Sequence) -> Tuple[list, list, list, list]:
        """``(src K, src V, dst K, dst V)``: entry lists (pointers or item lengths) of
        both sides, cut into K/V halves and ordered so position ``i`` of each pairs."""
        n, m = self.src_layers, self.dst_layers
        src_k, src_v = list(src[:n]), list(src[n:])
        dst_k = [dst[j] for j in self.dst_of]
        dst_v = [dst[m + j] for j in self.dst_of]
        return src_k, src_v, dst_k, dst_v

    @property
    def decode_only(self) -> List[int]:
        """Decode layers no prefill layer writes (their bytes must stay as they are)."""
        taken = set(self.dst_of)
        return [j for j in range(self.dst_layers) if j not in taken]


def _halves(side: str, n_entries: int, where: str) -> int:
    if n_entries < 2 or n_entries % 2:
        raise LayerPairingError(
            f"{where}: {side} registered {n_entries} buffers; a paged state component has a K and "
            "a V buffer per layer (an even number, at least 2)"
        )
    return n_entries // 2


def pair_state_layers(
    where: str,
    n_src_entries: int,
    n_dst_entries: int,
    *,
    pp_size: int = 1,
) -> LayerPairs:
    """How prefill's K/V buffers of one component map onto decode's.

    ``where`` names the component in errors (e.g. ``"state component 0 (swa)"``).
    Raises :class:`LayerPairingError` naming the component and both counts when
    the layers cannot be paired. (Where both sides publish state layer ids,
    0.5.23 pairs by them itself and never calls the positional function.)
    """
    n = _halves("prefill", n_src_entries, where)
    m = _halves("decode", n_dst_entries, where)
    if n == m:
        return LayerPairs(n, m, tuple(range(n)))
    counts = f"prefill has {n} layers ({n_src_entries} buffers), decode has {m} ({n_dst_entries} buffers)"
    if pp_size > 1:
        raise LayerPairingError(
            f"{where}: {counts}, prefill runs {pp_size} pipeline stages and no layer ids were "
            "published: which decode layers this stage holds is unknown, refusing rather than guessing"
        )
    if n > m:
        raise LayerPairingError(f"{where}: {counts}: decode lacks layers prefill would write")
    # Same model, same order, decode-only (draft) layers at the tail.
    return LayerPairs(n, m, tuple(range(n)))
