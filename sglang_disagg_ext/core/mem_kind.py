"""Which NIXL memory kind a buffer is registered and addressed as (F4). No SGLang import.

NIXL keeps host memory ("DRAM") and device memory ("VRAM") in separate
segments: a buffer must be registered with the kind where it really lives, and
every transfer descriptor must name the kind (and, for VRAM, the device) its
buffer was registered with on *that* side. Stock 0.5.10.post1 - 0.5.12.x
register KV and state buffers as "VRAM" unconditionally; UCX built without
CUDA then refuses the registration ("VRAM memory is detected as host"), so a
prefill or decode whose pools live in host memory cannot transfer at all.

Rules used here:

* A local buffer is "VRAM" when a pointer probe says it is device memory,
  "DRAM" when the probe says host memory. Without an answer (no probe, or
  the driver cannot tell) the server's device decides: an accelerator device
  (anything but "cpu") means "VRAM", the stock assumption; "cpu" means "DRAM".
* A remote buffer's kind is whatever the peer registered it as; the backend
  asks NIXL's copy of the peer's metadata (see ``backends/nixl/conn.py``).
* One transfer call uses one kind per side (SGLang builds one descriptor list
  per side); mixed kinds in one call are refused with the buffers named.
* NIXL addresses host memory with device id 0.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Mapping, Optional, Sequence

DRAM = "DRAM"
VRAM = "VRAM"
KINDS = (DRAM, VRAM)

# Devices whose pools SGLang allocates outside host memory.
_HOST_DEVICES = ("cpu",)

Probe = Callable[[int], Optional[bool]]  # True: device memory, False: host, None: unknown


class MemKindError(ValueError):
    """Buffers whose memory kind cannot be used as asked."""


def kind_for_device(device: Optional[str]) -> str:
    """The stock assumption for a server device string ("cuda:0", "cpu", "npu" ...)."""
    base = (device or "cuda").split(":", 1)[0].strip().lower()
    return DRAM if base in _HOST_DEVICES else VRAM


def classify(ptrs: Iterable[int], device: Optional[str], probe: Optional[Probe] = None) -> List[str]:
    """Memory kind of each local buffer (see the module rules).

    With a host device ("cpu") there is nothing to probe: SGLang allocates the
    pools on that device, so every buffer is host memory.
    """
    fallback = kind_for_device(device)
    out = []
    for ptr in ptrs:
        answer = None
        if probe is not None and fallback == VRAM and ptr:
            try:
                answer = probe(int(ptr))
            except Exception:  # noqa: BLE001 - a probe that breaks is a probe with no answer
                answer = None
        if answer is None:
            out.append(fallback)
        else:
            out.append(VRAM if answer else DRAM)
    return out


def device_id(kind: str, gpu_id: int) -> int:
    """Device id NIXL expects with ``kind``: the GPU for VRAM, 0 for host memory."""
    _check_kind(kind)
    return int(gpu_id) if kind == VRAM else 0


def single_kind(ptrs: Sequence[int], kinds: Mapping[int, str], what: str) -> str:
    """The one kind shared by every pointer in ``ptrs`` (looked up in ``kinds``).

    Raises ``MemKindError`` naming the buffers when a pointer is unknown or the
    kinds differ: one descriptor list cannot span two memory kinds.
    """
    seen = {}
    for ptr in ptrs:
        ptr = int(ptr)
        if ptr not in kinds:
            raise MemKindError(f"{what}: buffer 0x{ptr:x} was not registered (known: {len(kinds)} buffers)")
        seen.setdefault(kinds[ptr], ptr)
    if not seen:
        raise MemKindError(f"{what}: no buffers")
    if len(seen) > 1:
        detail = ", ".join(f"{k} (e.g. 0x{p:x})" for k, p in sorted(seen.items()))
        raise MemKindError(f"{what}: buffers of different memory kinds in one transfer: {detail}")
    return next(iter(seen))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise MemKindError(f"unknown memory kind {kind!r}; expected one of {KINDS}")
