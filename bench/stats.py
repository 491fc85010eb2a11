"""Medians of interleaved repeats. Pure: no SGLang, no torch.

Every figure of ``make bench`` is a ratio of two timings taken in the same run,
one sample of each side after the other, in an order that alternates
(A B, B A, A B, ...): on a shared machine a slow stretch then hits both sides
alike, and neither side always runs first (warm caches, a just-woken thread).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple


def median(values: Iterable[float]) -> float:
    """Median of the samples; refuses an empty list or a non-finite sample by name."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("median of no samples")
    bad = [v for v in xs if not math.isfinite(v)]
    if bad:
        raise ValueError(f"non-finite sample(s) {bad[:3]} among {len(xs)}")
    return statistics.median(xs)


def interleaved_order(names: Sequence[str], repeats: int) -> List[Tuple[int, str]]:
    """(repeat, name) pairs in run order: each repeat runs every name once, and
    odd repeats run them in reverse, so no name always goes first.

    >>> interleaved_order(["stock", "ext"], 3)
    [(0, 'stock'), (0, 'ext'), (1, 'ext'), (1, 'stock'), (2, 'stock'), (2, 'ext')]
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"names must be distinct and non-empty, got {list(names)}")
    out: List[Tuple[int, str]] = []
    for r in range(repeats):
        seq = list(names) if r % 2 == 0 else list(reversed(names))
        out.extend((r, n) for n in seq)
    return out


def run_interleaved(
    runs: Mapping[str, Callable[[], float]], repeats: int, warmup: int = 1
) -> Dict[str, List[float]]:
    """Call each ``runs[name]()`` (which returns one timing in seconds) in
    :func:`interleaved_order`; ``warmup`` untimed rounds first. Returns the samples."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for _, n in interleaved_order(names, repeats):
        samples[n].append(float(runs[n]()))
    return samples


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, refusing a zero or negative denominator by value."""
    if not (denominator > 0) or not math.isfinite(denominator):
        raise ValueError(f"ratio denominator must be a positive finite number, got {denominator!r}")
    return float(numerator) / float(denominator)


def quartiles(values: Sequence[float]) -> Dict[str, float]:
    """Median and lower / upper quartile (inclusive method) of the samples."""
    xs = sorted(float(v) for v in values)
    median(xs)  # refuses empty or non-finite samples by name
    if len(xs) == 1:
        return {"median": xs[0], "q1": xs[0], "q3": xs[0]}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2]}


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> Dict[str, float]:
    """Ratios of samples taken in the same repeat (``numerator[i] / denominator[i]``):
    their median, and lower and upper quartile (how far noise moves the ratio).

    Pairing cancels what changes slowly on a shared machine (other jobs' load):
    both samples of a pair ran back to back."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"need equally many samples on both sides, got {len(numerator)} and {len(denominator)}")
    return quartiles([ratio(n, d) for n, d in zip(numerator, denominator)])
