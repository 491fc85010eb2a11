"""Per-component hybrid-state wire format for the MoRI backend (F3). No SGLang import.

SGLang 0.5.12 made hybrid state per component (``state_types`` is a list; item
lengths, dims and memory descriptors are lists of lists), but MoRI's messages
stayed flat: ``_register_kv_args`` did ``struct.pack("I", item_len)`` over a
list and crashed (issue #26525). Upstream's fix (PR #26539) went to packed int
lists with no version tag, and it turns a missing component into an empty one.

Every payload here is ``MAGIC + version byte + kind byte + msgpack body``:

* MAGIC ``b"SDW\\xc1"`` cannot start an old flat payload by accident: as the
  first little-endian int32 of a raw index array it is negative (no valid
  index), as a uint32 item length it is 3.2 GB, and ``S`` is a msgpack fixint,
  never the array header an old descriptor list starts with.
* The kind byte keeps one field's bytes from being decoded as another's.
* Bodies, per component: state indices ``nil | bin(int32 LE)`` (nil = the
  component is missing, distinct from an empty index list); ints
  ``[uint, ...]``; descriptors ``[bin | nil, ...]`` (nil = unregistered
  zero-length tensor, as upstream keeps to stay index-aligned).

Decoding never raises anything but StateWireError. Input size, component
count and per-component lengths are capped before or while decoding: msgspec
refuses a forged array or bin length that exceeds the input, but a large
*real* input of one-byte elements can still build a list eight-plus times its
size, so the byte caps are what bound memory.
"""

from __future__ import annotations

import struct
from typing import Annotated, List, Optional, Sequence, Union

import msgspec
import numpy as np


class StateWireError(ValueError):
    """A state wire payload that cannot be encoded or must not be trusted."""


WIRE_MAGIC = b"SDW\xc1"
WIRE_VERSION = 1
_HEADER_LEN = len(WIRE_MAGIC) + 2

KIND_STATE_INDICES = ord("I")
KIND_INTS_PER_COMPONENT = ord("L")
KIND_MEM_DESCS_PER_COMPONENT = ord("D")
_KIND_NAMES = {
    KIND_STATE_INDICES: "state-indices",
    KIND_INTS_PER_COMPONENT: "per-component-ints",
    KIND_MEM_DESCS_PER_COMPONENT: "per-component-memory-descriptors",
}

# A hybrid model has a handful of state components (Mamba, SWA, NSA/DSA...).
MAX_COMPONENTS = 64
# Indices: enough for a 1M-token window at page size 1, per component.
MAX_INDICES_PER_COMPONENT = 1 << 22
MAX_STATE_INDICES_BYTES = 64 << 20
# Item lengths / dims / descriptors: one entry per tensor per layer.
MAX_ITEMS_PER_COMPONENT = 1 << 16
MAX_INTS_BYTES = 1 << 20
MAX_MEM_DESCS_BYTES = 4 << 20
MAX_MEM_DESC_BYTES = 1 << 16  # one packed MemoryDesc

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1

_encoder = msgspec.msgpack.Encoder()
_state_indices_decoder = msgspec.msgpack.Decoder(Optional[List[Optional[bytes]]])
_ints_decoder = msgspec.msgpack.Decoder(
    List[List[Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]]]
)
_mem_descs_decoder = msgspec.msgpack.Decoder(List[List[Optional[bytes]]])

BytesLike = Union[bytes, bytearray, memoryview]


def _frame(kind: int, body: object) -> bytes:
    return WIRE_MAGIC + bytes((WIRE_VERSION, kind)) + _encoder.encode(body)


def _describe_foreign(payload: bytes) -> str:
    """Best guess at what an unversioned payload is, for the error message."""
    if not payload:
        return (
            "empty payload (an unversioned peer, e.g. SGLang 0.5.12.x MoRI, sends "
            "b'' for 'no state')"
        )
    first = payload[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return (
            "a bare msgpack list: the flat memory-descriptor list of SGLang "
            "0.5.12.x MoRI, or upstream's unversioned nested one"
        )
    if len(payload) % 4 == 0:
        (n,) = struct.unpack_from("<I", payload)
        # Upstream encodes zero lists as b"", so a real one has n >= 1.
        if 1 <= n <= MAX_COMPONENTS and len(payload) >= 4 + 4 * n:
            lens = struct.unpack_from(f"<{n}I", payload, 4)
            if 4 + 4 * n + sum(lens) == len(payload):
                return "upstream's unversioned pack_int_lists layout (SGLang 0.5.13.post1+ MoRI)"
        return (
            "a raw 32-bit int array: the flat state indices / item lengths of "
            "SGLang 0.5.12.x MoRI"
        )
    return "not a state wire payload"


def _open(payload: object, kind: int, max_bytes: int) -> memoryview:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise StateWireError(f"state wire payload must be bytes, got {type(payload).__name__}")
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    # Checked before copying or parsing anything.
    if size > max_bytes + _HEADER_LEN:
        raise StateWireError(
            f"{_KIND_NAMES[kind]} payload of {size} bytes exceeds the {max_bytes}-byte cap"
        )
    data = payload if isinstance(payload, bytes) else bytes(payload)
    if not data.startswith(WIRE_MAGIC):
        raise StateWireError(
            f"refusing {_KIND_NAMES[kind]} payload: {_describe_foreign(data)}. "
            f"This peer speaks the per-component state wire v{WIRE_VERSION} "
            f"(sglang_disagg_ext mori-ext); run the same plugin on both sides"
        )
    if len(data) < _HEADER_LEN:
        raise StateWireError(f"truncated state wire header ({len(data)} bytes)")
    version, got_kind = data[len(WIRE_MAGIC)], data[len(WIRE_MAGIC) + 1]
    if version != WIRE_VERSION:
        raise StateWireError(
            f"state wire version {version} from peer; this side speaks {WIRE_VERSION}"
        )
    if got_kind != kind:
        raise StateWireError(
            f"expected a {_KIND_NAMES[kind]} payload, got a "
            f"{_KIND_NAMES.get(got_kind, f'unknown-kind ({got_kind})')} one"
        )
    body = memoryview(data)[_HEADER_LEN:]
    _check_component_count(body)
    return body


def _check_component_count(body: memoryview) -> None:
    # Read the outer msgpack array header ourselves so a forged count is
    # refused before msgspec starts building the list.
    if not body:
        raise StateWireError("truncated state wire body")
    first = body[0]
    if 0x90 <= first <= 0x9F:
        count = first & 0x0F
    elif first == 0xDC and len(body) >= 3:
        count = int.from_bytes(body[1:3], "big")
    elif first == 0xDD and len(body) >= 5:
        count = int.from_bytes(body[1:5], "big")
    else:
        return  # nil, or not an array: msgspec's typed decoder will say so
    if count > MAX_COMPONENTS:
        raise StateWireError(f"{count} state components exceed the cap of {MAX_COMPONENTS}")


def _decode(decoder: msgspec.msgpack.Decoder, body: memoryview, kind: int):
    try:
        return decoder.decode(body)
    # Untrusted bytes: whatever msgspec raises (DecodeError, ValidationError,
    # and in principle RecursionError/MemoryError) becomes one error type.
    except Exception as exc:
        raise StateWireError(f"malformed {_KIND_NAMES[kind]} payload: {exc}") from None


def _check_components(values) -> None:
    if len(values) > MAX_COMPONENTS:
        raise StateWireError(f"{len(values)} state components exceed the cap of {MAX_COMPONENTS}")


# --- state indices ------------------------------------------------------------


def encode_state_indices(
    state_indices: Optional[Sequence[Optional[Union[Sequence[int], np.ndarray]]]],
) -> bytes:
    """Per-component state indices -> bytes; None (no state at all) and None
    components (component missing) survive the round trip, distinct from []."""
    if state_indices is None:
        return _frame(KIND_STATE_INDICES, None)
    if isinstance(state_indices, (str, bytes)) or not isinstance(state_indices, Sequence):
        raise StateWireError(f"state indices must be a list per component, got {type(state_indices).__name__}")
    _check_components(state_indices)
    body: List[Optional[bytes]] = []
    for i, entry in enumerate(state_indices):
        if entry is None:
            body.append(None)
            continue
        try:
            arr = np.asarray(entry).ravel()
        except Exception as exc:
            raise StateWireError(f"state component {i}: not an index array ({exc})") from None
        if arr.size == 0:
            body.append(b"")
            continue
        if arr.dtype.kind not in "iu":
            raise StateWireError(f"state component {i}: indices must be integers, got {arr.dtype}")
        if arr.size > MAX_INDICES_PER_COMPONENT:
            raise StateWireError(f"state component {i}: {arr.size} indices exceed the cap")
        if int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX:
            raise StateWireError(f"state component {i}: index outside int32")
        body.append(arr.astype("<i4").tobytes())
    out = _frame(KIND_STATE_INDICES, body)
    if len(out) > MAX_STATE_INDICES_BYTES + _HEADER_LEN:
        raise StateWireError(f"encoded state indices of {len(out)} bytes exceed the cap")
    return out


def decode_state_indices(payload: BytesLike) -> Optional[List[Optional[np.ndarray]]]:
    """Bytes -> None, or one int32 array (or None for a missing component) per component."""
    body = _open(payload, KIND_STATE_INDICES, MAX_STATE_INDICES_BYTES)
    decoded = _decode(_state_indices_decoder, body, KIND_STATE_INDICES)
    if decoded is None:
        return None
    _check_components(decoded)
    out: List[Optional[np.ndarray]] = []
    for i, blob in enumerate(decoded):
        if blob is None:
            out.append(None)
            continue
        if len(blob) % 4:
            raise StateWireError(f"state component {i}: {len(blob)} bytes is not whole int32s")
        if len(blob) // 4 > MAX_INDICES_PER_COMPONENT:
            raise StateWireError(f"state component {i}: {len(blob) // 4} indices exceed the cap")
        # astype copies: a writable, native-order array that owns its memory.
        out.append(np.frombuffer(blob, dtype="<i4").astype(np.int32))
    return out


# --- item lengths / dims per component ----------------------------------------


def encode_ints_per_component(lists: Sequence[Sequence[int]]) -> bytes:
    """Per-component non-negative ints (item lengths, dims per tensor) -> bytes."""
    if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence):
        raise StateWireError(f"expected a list per component, got {type(lists).__name__}")
    _check_components(lists)
    body: List[List[int]] = []
    for i, comp in enumerate(lists):
        if comp is None or isinstance(comp, (str, bytes)):
            raise StateWireError(f"component {i}: expected a list of ints, got {comp!r}")
        try:
            items = list(comp)
        except TypeError:
            raise StateWireError(f"component {i}: expected a list of ints, got {comp!r}") from None
        # int() would quietly accept 2.7 or True as an item length.
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in items):
            raise StateWireError(f"component {i}: expected a list of ints, got {items!r}")
        values = [int(v) for v in items]
        if len(values) > MAX_ITEMS_PER_COMPONENT:
            raise StateWireError(f"component {i}: {len(values)} items exceed the cap")
        if values and (min(values) < 0 or max(values) > _INT64_MAX):
            raise StateWireError(f"component {i}: ints must be in [0, 2**63)")
        body.append(values)
    out = _frame(KIND_INTS_PER_COMPONENT, body)
    if len(out) > MAX_INTS_BYTES + _HEADER_LEN:
        raise StateWireError(f"encoded ints of {len(out)} bytes exceed the cap")
    return out


def decode_ints_per_component(payload: BytesLike) -> List[List[int]]:
    """Bytes -> list of int lists, one per component."""
    body = _open(payload, KIND_INTS_PER_COMPONENT, MAX_INTS_BYTES)
    decoded = _decode(_ints_decoder, body, KIND_INTS_PER_COMPONENT)
    _check_components(decoded)
    for i, comp in enumerate(decoded):
        if len(comp) > MAX_ITEMS_PER_COMPONENT:
            raise StateWireError(f"component {i}: {len(comp)} items exceed the cap")
    return decoded


# --- memory descriptors per component -----------------------------------------


def encode_mem_descs_per_component(
    descs: Sequence[Sequence[Optional[BytesLike]]],
) -> bytes:
    """Per-component packed memory descriptors (``MemoryDesc.pack()`` bytes, or
    None for an unregistered zero-length tensor) -> bytes."""
    if isinstance(descs, (str, bytes)) or not isinstance(descs, Sequence):
        raise StateWireError(f"expected a list per component, got {type(descs).__name__}")
    _check_components(descs)
    body: List[List[Optional[bytes]]] = []
    for i, comp in enumerate(descs):
        if comp is None or isinstance(comp, (str, bytes)) or not isinstance(comp, Sequence):
            raise StateWireError(f"component {i}: expected a list of packed descriptors, got {comp!r}")
        if len(comp) > MAX_ITEMS_PER_COMPONENT:
            raise StateWireError(f"component {i}: {len(comp)} descriptors exceed the cap")
        row: List[Optional[bytes]] = []
        for j, desc in enumerate(comp):
            if desc is None:
                row.append(None)
            elif isinstance(desc, (bytes, bytearray, memoryview)):
                blob = bytes(desc)
                if len(blob) > MAX_MEM_DESC_BYTES:
                    raise StateWireError(f"component {i} descriptor {j}: {len(blob)} bytes exceed the cap")
                row.append(blob)
            else:
                raise StateWireError(
                    f"component {i} descriptor {j}: expected packed bytes "
                    f"(MemoryDesc.pack()), got {type(desc).__name__}"
                )
        body.append(row)
    out = _frame(KIND_MEM_DESCS_PER_COMPONENT, body)
    if len(out) > MAX_MEM_DESCS_BYTES + _HEADER_LEN:
        raise StateWireError(f"encoded descriptors of {len(out)} bytes exceed the cap")
    return out


def decode_mem_descs_per_component(payload: BytesLike) -> List[List[Optional[bytes]]]:
    """Bytes -> per-component lists of packed descriptors (None kept in place);
    the caller turns each into a ``MemoryDesc`` with ``MemoryDesc.unpack``."""
    body = _open(payload, KIND_MEM_DESCS_PER_COMPONENT, MAX_MEM_DESCS_BYTES)
    decoded = _decode(_mem_descs_decoder, body, KIND_MEM_DESCS_PER_COMPONENT)
    _check_components(decoded)
    for i, comp in enumerate(decoded):
        if len(comp) > MAX_ITEMS_PER_COMPONENT:
            raise StateWireError(f"component {i}: {len(comp)} descriptors exceed the cap")
        for j, desc in enumerate(comp):
            if desc is not None and len(desc) > MAX_MEM_DESC_BYTES:
                raise StateWireError(f"component {i} descriptor {j}: {len(desc)} bytes exceed the cap")
    return decoded
