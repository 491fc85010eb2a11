"""The transfer digest: a linear sum over destination words. No SGLang, no torch.

Definition (frame version 2). A transfer writes bytes into destination *items*
(one page of one buffer of one component). View every item as little-endian
unsigned 64-bit words ``x_k = sum_{j<8} item[8k + j] * 256**j``; an item whose
length is not a multiple of 8 gets zero bytes after its end, so its last word
is the zero-padded tail. Then::

    v(item) = sum_k x_k * base(k)                                  (mod 2**64)
    digest  = sum over written items of  v(item) * page_factor(c, b, p)   (mod 2**64)

* ``c`` component: 0 KV, 1 aux (metadata row), 2 + i state component ``i``
  (the harness's pool ids); ``b`` the *destination* buffer index within the
  component; ``p`` the *destination* page (item) index; ``k`` the word offset
  in the destination item.
* ``base(k) = splitmix64(k) | 1``;
  ``page_factor(c, b, p) = buffer_factor(c, b) * slot_factor(p)`` with
  ``buffer_factor(c, b) = splitmix64((c << 48) ^ (b << 32) ^ PAGE_SALT) | 1`` and
  ``slot_factor(p) = splitmix64(p ^ SLOT_SALT) | 1``: all odd, so every weight
  ``base(k) * page_factor`` is odd. The page part splits into a buffer part and
  a slot part so a kernel looks the slot factors up in one table shared by all
  buffers and multiplies each buffer's sum once. The salts keep the three
  parts' splitmix inputs apart for realistic indices; inputs that coincide
  would only make two factors equal, which none of the properties below uses.

Why this shape:

* Byte-separable: a byte ``y`` at offset ``i`` of an item contributes
  ``y * 256**(i % 8) * base(i // 8) * page_factor`` (mod 2**64), and the whole
  item's digest is exactly the sum of its bytes' contributions (the word is a
  sum of its bytes mod 2**64, and everything is mod 2**64). So the digest of a
  set of writes is the sum of the digests of its parts at any byte granularity:
  prefill ranks that each write part of a decode item (a head slice, a cut
  inside a word) compose exactly, and decode's own digest over the items equals
  the sum of the source ranks' partials.
* Any single changed word (so any changed byte or 4-byte group, which lie in
  one word) changes the digest: the item's ``v`` changes by ``d * base(k)``
  with ``d != 0 (mod 2**64)`` and ``base(k)`` odd, hence invertible mod 2**64,
  so ``v`` changes; the odd page factor keeps the change non-zero. Changes in
  several words can cancel (probability about ``2**-64`` for unrelated
  changes); this is a check against corruption, not an adversary.
* Cheap: each word is multiplied and summed in the word's own 64-bit width
  (no widening, no temporaries: ``backends.common.digest_kernels`` uses one numpy ``einsum``
  pass over the pool's bytes on CPU, one int64 multiply-and-sum on CUDA), and
  the page part is one multiply per item. Version 1 used 32-bit words widened
  to int64 and was 10x a gather of the same bytes.

Wire frame (prefill -> decode, trailing frame of the Success status): see
:func:`encode_frame`. Its magic names the version: a decode that reads another
version's frame ignores it and the room goes unverified, never failed.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

MASK = (1 << 64) - 1
KV_COMPONENT = 0
AUX_COMPONENT = 1
STATE_COMPONENT_BASE = 2

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Keep buffer_factor and slot_factor inputs away from word offsets (base(k)) and each other.
_PAGE_SALT = 0x5EED_D16E_57A1_0000
_SLOT_SALT = 0x5107_FAC7_0000_0000

FRAME_MAGIC = b"SDXV2"  # sglang-disagg-ext verify, version 2 (64-bit words)
WORD_BYTES = 8


class DigestError(ValueError):
    """A malformed digest frame or an index outside what the digest can name."""


def splitmix64(z: int) -> int:
    """One splitmix64 output for input ``z`` (mod 2**64)."""
    z = (z + _GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * _M1) & MASK
    z = ((z ^ (z >> 27)) * _M2) & MASK
    return z ^ (z >> 31)


_GOLDEN_NP, _M1_NP, _M2_NP = np.uint64(_GOLDEN), np.uint64(_M1), np.uint64(_M2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _splitmix64_np(z) -> np.ndarray:
    """:func:`splitmix64` of every element, as a new 1-D uint64 array.

    Array arithmetic on uint64 wraps silently (numpy checks overflow on scalars
    only), so no ``errstate`` is needed; ``ndmin=1`` keeps a single input an
    array. In place on the copy: the verify kernels call this per transfer."""
    z = np.array(z, dtype=np.uint64, ndmin=1)
    z += _GOLDEN_NP
    z ^= z >> _S30
    z *= _M1_NP
    z ^= z >> _S27
    z *= _M2_NP
    z ^= z >> _S31
    return z


def base(k: int) -> int:
    """Weight factor of word offset ``k`` within an item (odd)."""
    return splitmix64(k) | 1


def base_vector(n_words: int) -> np.ndarray:
    """``base(0 .. n_words-1)`` as uint64."""
    return _splitmix64_np(np.arange(n_words, dtype=np.uint64)) | np.uint64(1)


def byte_weight_vector(item_bytes: int) -> np.ndarray:
    """Per-byte weights of one item: ``256**(i % 8) * base(i // 8)`` (uint64, wrapping)."""
    n_words = -(-item_bytes // WORD_BYTES)
    b = np.repeat(base_vector(n_words), WORD_BYTES)[:item_bytes]
    shifts = (np.arange(item_bytes, dtype=np.uint64) % np.uint64(WORD_BYTES)) * np.uint64(8)
    with np.errstate(over="ignore"):
        return b * (np.uint64(1) << shifts)


def _key(component: int, buffer: int, page: int) -> int:
    if not 0 <= component < 1 << 16 or not 0 <= buffer < 1 << 16 or not 0 <= page < 1 << 32:
        raise DigestError(f"digest index out of range: component {component}, buffer {buffer}, page {page}")
    return (component << 48) ^ (buffer << 32) ^ page ^ _PAGE_SALT


def buffer_factor(component: int, buffer: int) -> int:
    """Weight factor of destination buffer (component, buffer) (odd)."""
    return splitmix64(_key(component, buffer, 0)) | 1


def slot_factor(page: int) -> int:
    """Weight factor of destination page (item) index ``page`` (odd)."""
    _key(0, 0, page)  # range check
    return splitmix64(page ^ _SLOT_SALT) | 1


def slot_factors(pages: Sequence[int]) -> np.ndarray:
    """``slot_factor`` of many pages, as uint64 (:class:`DigestError` for a page outside [0, 2**32))."""
    keys = np.asarray(pages, dtype=np.int64).astype(np.uint64)
    if keys.size and (keys >> np.uint64(32)).any():  # negative pages wrap to >= 2**63
        bad = np.asarray(pages, dtype=np.int64)
        bad = int(bad[(bad < 0) | (bad >= 1 << 32)][0])
        raise DigestError(f"digest page {bad} out of range")
    keys ^= np.uint64(_SLOT_SALT)
    z = _splitmix64_np(keys)
    z |= np.uint64(1)
    return z


def page_factor(component: int, buffer: int, page: int) -> int:
    """Weight factor of destination item (component, buffer, page): ``buffer_factor * slot_factor`` (odd)."""
    return (buffer_factor(component, buffer) * slot_factor(page)) & MASK


def page_factors(component: int, buffer: int, pages: Sequence[int]) -> np.ndarray:
    """``page_factor`` for many pages of one buffer, as uint64."""
    try:
        z = slot_factors(pages)
    except DigestError as exc:
        raise DigestError(f"{exc} in component {component} buffer {buffer}") from None
    z *= np.uint64(buffer_factor(component, buffer))  # uint64 array arithmetic wraps
    return z


def item_digest(data: bytes, component: int, buffer: int, page: int, offset: int = 0) -> int:
    """Reference digest of ``data`` written at byte ``offset`` of destination item
    (component, buffer, page). Plain Python, for tests and small cases."""
    m = page_factor(component, buffer, page)
    total = 0
    for i, y in enumerate(data):
        pos = offset + i
        total += y * (1 << (8 * (pos % WORD_BYTES))) * base(pos // WORD_BYTES)
    return (total * m) & MASK


def combine(partials: Iterable[int]) -> int:
    """Sum of partial digests (mod 2**64): what decode compares with its own."""
    total = 0
    for p in partials:
        total += p
    return total & MASK


# -- wire frame ---------------------------------------------------------------

Digests = Dict[Tuple[int, int], int]  # (component, destination buffer) -> digest
Pages = Dict[int, List[int]]  # component -> destination pages written (sorted, unique)


def encode_frame(digests: Mapping[Tuple[int, int], int], pages: Mapping[int, Iterable[int]]) -> bytes:
    """``FRAME_MAGIC`` (``SDXV2``) + u32 n_entries + n x (u16 component, u16 buffer, u64 digest)
    + u32 n_components + per component (u16 component, u32 n_pages, n x u32 page)."""
    out = [FRAME_MAGIC, struct.pack("<I", len(digests))]
    for (c, b), d in sorted(digests.items()):
        _key(c, b, 0)
        out.append(struct.pack("<HHQ", c, b, d & MASK))
    out.append(struct.pack("<I", len(pages)))
    for c, ps in sorted(pages.items()):
        ps = sorted(set(int(p) for p in ps))
        _key(c, 0, ps[-1] if ps else 0)
        out.append(struct.pack("<HI", c, len(ps)))
        out.append(np.asarray(ps, dtype="<u4").tobytes())
    return b"".join(out)


def decode_frame(frame: bytes) -> Tuple[Digests, Pages]:
    """Inverse of :func:`encode_frame`; :class:`DigestError` on anything malformed."""
    if not frame.startswith(FRAME_MAGIC):
        raise DigestError("not a digest frame (bad magic)")
    pos = len(FRAME_MAGIC)
    try:
        (n,) = struct.unpack_from("<I", frame, pos)
        pos += 4
        digests: Digests = {}
        for _ in range(n):
            c, b, d = struct.unpack_from("<HHQ", frame, pos)
            pos += 12
            digests[(c, b)] = d
        (n_comp,) = struct.unpack_from("<I", frame, pos)
        pos += 4
        pages: Pages = {}
        for _ in range(n_comp):
            c, n_pages = struct.unpack_from("<HI", frame, pos)
            pos += 6
            end = pos + 4 * n_pages
            if end > len(frame):
                raise DigestError(f"digest frame truncated in component {c}'s page list")
            pages[c] = np.frombuffer(frame[pos:end], dtype="<u4").astype(np.int64).tolist()
            pos = end
    except struct.error as exc:
        raise DigestError(f"digest frame truncated: {exc}") from None
    if pos != len(frame):
        raise DigestError(f"digest frame has {len(frame) - pos} trailing bytes")
    for c, b in digests:
        if c not in pages:
            raise DigestError(f"digest frame names component {c} buffer {b} but no pages for it")
    return digests, pages


def merge_frames(frames: Mapping[int, Tuple[Digests, Pages]]) -> Tuple[Digests, Pages, Dict[Tuple[int, int], List[int]]]:
    """Partials of several source ranks (rank -> decoded frame) combined: summed
    digests per (component, buffer), the union of pages per component, and which
    source ranks contributed to each (component, buffer).

    Ranks that report the same digest for a (component, buffer) over the same pages
    of that component wrote the same bytes to the same places (SGLang has every
    prefill rank of a larger TP send the aux row and unsliced state to a smaller
    decode TP): their copy counts once, as it landed once. Distinct parts (head
    slices) differ in their digests, since every byte's weight depends on its
    offset; two different writes agreeing by chance is the digest's ``2**-64``."""
    sums: Dict[Tuple[int, int], List[int]] = {}
    ranks: Dict[Tuple[int, int], List[int]] = {}
    pages: Dict[int, set] = {}
    seen: Dict[Tuple[int, int], set] = {}
    for rank in sorted(frames):
        digests, rank_pages = frames[rank]
        page_sets = {c: frozenset(ps) for c, ps in rank_pages.items()}  # once per component, not per buffer
        for key, d in digests.items():
            ranks.setdefault(key, []).append(rank)
            copy = (d, page_sets.get(key[0], frozenset()))
            if copy not in seen.setdefault(key, set()):
                seen[key].add(copy)
                sums.setdefault(key, []).append(d)
        for c, ps in rank_pages.items():
            pages.setdefault(c, set()).update(ps)
    return (
        {k: combine(v) for k, v in sums.items()},
        {c: sorted(ps) for c, ps in pages.items()},
        ranks,
    )


def component_name(component: int) -> str:
    if component == KV_COMPONENT:
        return "kv"
    if component == AUX_COMPONENT:
        return "aux"
    return f"state{component - STATE_COMPONENT_BASE}"


def first_mismatch(expected: Mapping[Tuple[int, int], int], actual: Mapping[Tuple[int, int], int]) -> Optional[Tuple[int, int]]:
    """The lowest (component, buffer) whose digests differ (or is missing in ``actual``), else None."""
    for key in sorted(expected):
        if actual.get(key) != expected[key]:
            return key
    return None
