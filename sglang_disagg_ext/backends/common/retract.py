"""F5: retract/resume state aliasing on the decode side.

On SGLang 0.5.10.post1 and 0.5.11 a retracted decode request frees its slots,
other requests reuse them, and the retracted request still points at them:

* ``MetadataBuffers.get_buf(idx)`` returns *views* of the slot
  (0.5.11 ``disaggregation/utils.py:244``), so a later ``set_buf`` on the reused
  slot changes what the retracted request reads when it resumes.
* ``NSATokenToKVPool`` (0.5.11 ``mem_cache/memory_pool.py:1862``) inherits
  ``get_cpu_copy`` / ``load_cpu_copy`` from ``MLATokenToKVPool`` (:975, :993),
  which offload and restore only ``kv_buffer``. The page-indexed
  ``index_k_with_scale_buffer`` stays on the device, is overwritten by other
  requests, and NSA attention reads garbage after resume. The inherited
  ``_clear_buffers`` (:1570) leaves that buffer allocated.

SGLang 0.5.12 / 0.5.12.post1 carry upstream's fix, but its NSA offload is
``get_cpu_copy(self, indices)`` (0.5.12.post1 ``mem_cache/memory_pool.py:2145``)
while ``PagedTokenToKVPoolAllocator.get_cpu_copy`` calls it with
``mamba_indices=`` (``allocator.py:524``): every retract on an NSA pool raises
TypeError there. The same hooks are installed on 0.5.12.x; their ``get_buf``
copy and ``_clear_buffers`` only repeat what that release already does.

What this module installs (one function, :func:`install_retract_fixes`):

* ``MetadataBuffers.get_buf`` returns copies (whatever fields the release's own
  ``get_buf`` returns, each cloned).
* ``NSATokenToKVPool.get_cpu_copy`` / ``load_cpu_copy`` offload and restore the
  KV rows *and* the index-key pages of the request, per layer, in chunks of the
  pool's own ``cpu_offloading_chunk_size`` (tokens for KV, whole pages for the
  index keys). They take the base class's arguments in every release
  (``(indices)`` in 0.5.10.post1, ``(indices, mamba_indices=None)`` in 0.5.11
  and 0.5.12.x, extra keywords tolerated) and return an :class:`NSACpuCopy`: a ``list`` laid
  out exactly like the base class's return value (one list of KV chunks per
  layer) that also carries the index-key chunks. Stock retract callers treat the
  value as opaque (``Req.offload_kv_cache`` stores it, ``load_kv_cache`` hands it
  back), and anything that reads it as the base layout still can.
* They synchronise the pool's own device (``torch.<type>.synchronize``; nothing
  on CPU) instead of calling ``torch.cuda.synchronize()`` unconditionally, so
  they work on CPU, CUDA and other device pools.
* ``NSATokenToKVPool._clear_buffers`` releases the index-key buffer too.

The fix is a hook on the classes, not a subclass: SGLang builds the NSA pool
(target and MTP draft) in ``model_runner_kv_cache_mixin.py`` but checks
``isinstance(..., NSATokenToKVPool)`` in many places (disagg prefill/decode, the
NSA indexer), ``HiSparseNSATokenToKVPool`` subclasses it, and ``MetadataBuffers``
is built in two places of ``scheduler.py`` (0.5.11 :1190, :1243). Patching the
class reaches every construction site, every subclass that does not override
the method itself (HiSparse keeps its own ``NotImplementedError`` offload), and
every module that imported the name.
The originals are recorded, so :func:`uninstall_retract_fixes` (or
:func:`retract_fixes`) restores stock behaviour in the same process.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang_disagg_ext import metrics, releases, verification
from sglang_disagg_ext.backends.common import hooks
from sglang_disagg_ext.backends.common.digest_kernels import rows_digests
from sglang_disagg_ext.core import digest as dg
from sglang_disagg_ext.core.page_chunks import chunk_bounds, page_chunk_rows, page_starts, restore_bounds

logger = logging.getLogger("sglang_disagg_ext")

_EXT_MARK = "_sglang_disagg_ext_fix"
_MISSING = object()

# (class, attribute) -> what the class's own __dict__ held before we patched
# (_MISSING when the attribute was inherited).
_originals: Dict[Tuple[type, str], object] = {}


# --------------------------------------------------------------------------
# Device synchronisation
# --------------------------------------------------------------------------


def synchronize_device(device) -> None:
    """Wait for pending work on ``device``: ``torch.<type>.synchronize(device)``.

    Nothing to do for CPU (or meta) tensors. Backends whose ``synchronize``
    takes no device argument (``torch.mps``) are called without one.
    """
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None)
    if sync is None:
        return
    try:
        sync(device)
    except TypeError:
        sync()


def _pool_device(pool) -> torch.device:
    return pool.kv_buffer[0].device


# --------------------------------------------------------------------------
# Chunked row offload / restore (per layer)
# --------------------------------------------------------------------------


def _wide_view(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` reinterpreted with 8-byte elements when its rows allow it, else ``buf``.

    Offload and restore move whole rows bit for bit; gathering or scattering a row
    of 8448 uint8 index-key bytes as 1056 int64 is several times faster on CPU,
    and no slower on a GPU. Host copies get the same view, so gather and scatter
    both move 8-byte words. Falls back to ``buf`` if the layout does not permit
    the view.
    """
    if buf.element_size() >= 8 or buf.dim() == 0:
        return buf
    try:
        return buf.view(torch.int64)
    except RuntimeError:
        return buf


def _row_index(rows, device: torch.device) -> torch.Tensor:
    """``rows`` as one int64 index tensor on ``device``: converted once per call, not per chunk."""
    return torch.as_tensor(rows).to(device=device, dtype=torch.int64)


def _host_rows(buf: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """New host memory of ``shape`` + ``buf``'s row shape, in ``buf``'s dtype: pinned for a CUDA
    pool, so the device-to-host copies into it are asynchronous."""
    pin = buf.device.type == "cuda"
    return torch.empty((*shape, *buf.shape[1:]), dtype=buf.dtype, pin_memory=pin)


_row_item_dtypes: Dict[int, object] = {}


def _row_item_dtype(row_bytes: int):
    """NumPy's opaque ``void`` dtype of ``row_bytes`` bytes (built once per size: building one is slow)."""
    dtype = _row_item_dtypes.get(row_bytes)
    if dtype is None:
        dtype = _row_item_dtypes[row_bytes] = np.dtype((np.void, row_bytes))
    return dtype


def _numpy_rows(t: torch.Tensor):
    """``t``'s rows as a 1-D NumPy array of opaque row-sized items over the same memory,
    or None: not on CPU, no NumPy, no rows, or rows that are not contiguous."""
    if not t.is_cpu or t.dim() == 0 or t.shape[0] == 0:
        return None
    try:
        if t.dtype is not torch.uint8:
            t = t.view(torch.uint8)
        if t.dim() != 2:
            t = t.view(t.shape[0], -1)  # a view or RuntimeError, never a copy
        arr = t.numpy()
        return arr.view(_row_item_dtype(arr.shape[1]))[:, 0]
    except (ImportError, RuntimeError, TypeError, ValueError):
        return None


def _numpy_index(index: torch.Tensor):
    """A CPU int64 row index as a NumPy array; negative rows raise ``IndexError`` as ``index_copy_``
    does (NumPy would wrap them; rows past the end raise ``IndexError`` in NumPy itself)."""
    idx = index.numpy()
    if idx.size and int(idx.min()) < 0:
        raise IndexError(f"row index {int(idx.min())} is out of bounds")
    return idx


def offload_rows(buffers: Sequence[torch.Tensor], rows, chunk_rows: int, layer_num: int) -> List[List[torch.Tensor]]:
    """Copy ``buffers[layer][rows]`` to the host, per layer, ``chunk_rows`` rows at a time.

    Each stored chunk has the buffer's own dtype and row shape (the base class's
    layout). The chunks are row slices of one new host tensor per layer. On a CPU pool
    that tensor is the copy itself: one gather
    per layer writes straight into it, with no temporary. On a device pool each chunk
    is gathered on the device and copied into the (pinned) host tensor; the gathered
    chunk is dropped as soon as its copy is issued, so at most one chunk is in flight
    besides the result (the caching allocator reuses it in stream order for the next).
    """
    n_rows = len(rows)
    bounds = chunk_bounds(n_rows, chunk_rows)
    if layer_num <= 0:
        return []
    first = buffers[0]
    index = _row_index(rows, first.device)
    out: List[List[torch.Tensor]] = []
    for layer_id in range(layer_num):
        buf = buffers[layer_id]
        # One host tensor per layer, not one for all layers: a single allocation of every layer's
        # rows (138 MB for 2048 index-key pages x 8 layers) comes fresh from the OS on each offload,
        # and gathering into it ran at 1.5 GB/s on this project's CPU machine (89 ms against 16 ms
        # into per-layer tensors, which the allocator serves from memory it already has, as it does
        # the per-layer tensors of stock's plain copy).
        host = _host_rows(buf, (n_rows,))
        wide = _wide_view(buf)
        host_wide = host.view(wide.dtype)
        idx = index if buf.device == index.device else index.to(buf.device)
        if buf.device.type == "cpu":
            torch.index_select(wide, 0, idx, out=host_wide)
        else:
            for s, e in bounds:
                part = wide.index_select(0, idx[s:e])
                host_wide[s:e].copy_(part, non_blocking=True)
                del part
        out.append([host[s:e] for s, e in bounds])
    return out


def restore_rows(buffers: Sequence[torch.Tensor], stored: Sequence[Sequence[torch.Tensor]], rows, layer_num: int, what: str) -> None:
    """Write stored host chunks back to ``buffers[layer][rows]``, following the stored chunking.

    Every layer's chunks are checked against the rows and the buffer before any row
    is written. On a device pool each chunk is copied to the device, scattered and
    dropped before the next one, so restore never holds two chunks on the device.
    """
    if len(stored) != layer_num:
        raise ValueError(f"{what}: stored copy has {len(stored)} layers, pool has {layer_num}")
    n_rows = len(rows)
    plans = []
    for layer_id in range(layer_num):
        chunks = stored[layer_id]
        buf = buffers[layer_id]
        bounds = restore_bounds([c.shape[0] for c in chunks], n_rows)
        for chunk in chunks:
            if chunk.dtype != buf.dtype or chunk.shape[1:] != buf.shape[1:]:
                raise ValueError(
                    f"{what}: stored chunk {tuple(chunk.shape)} {chunk.dtype} does not fit rows "
                    f"{tuple(buf.shape[1:])} {buf.dtype}"
                )
        plans.append(bounds)
    index = index_np = None
    for layer_id, bounds in enumerate(plans):
        buf = buffers[layer_id]
        if index is None or index.device != buf.device:
            index = _row_index(rows, buf.device)
        # On CPU each row is written as one opaque item by NumPy's indexed assignment, on views
        # of the same memory: one block copy per row, where ``index_copy_`` moves the row 8 bytes
        # at a time (about 1.5x slower). Anything else (a device pool, a chunk whose rows are not
        # contiguous) goes through ``index_copy_`` on the 8-byte view.
        dst_rows = _numpy_rows(buf)
        wide = None
        for (s, e), chunk in zip(bounds, stored[layer_id]):
            src = chunk.to(buf.device, non_blocking=True)
            src_rows = _numpy_rows(src) if dst_rows is not None else None
            if src_rows is not None and src_rows.dtype == dst_rows.dtype:
                if index_np is None:
                    index_np = _numpy_index(index)
                dst_rows[index_np[s:e]] = src_rows
            else:
                if wide is None:
                    wide = _wide_view(buf)
                wide.index_copy_(0, index[s:e], src.contiguous().view(wide.dtype))
            # Drop the device copy now, so restore never holds two chunks on the device.
            del src


# --------------------------------------------------------------------------
# The NSA pool's offload value
# --------------------------------------------------------------------------


class NSACpuCopy(list):
    """Host copy of one request's NSA pool state.

    The list itself is the base class's layout (``MLATokenToKVPool.get_cpu_copy``):
    one list of KV chunks per layer. ``index_k`` holds the index-key/scale page
    chunks in the same per-layer, per-chunk shape. ``digests``: with verification
    on, :func:`retract_digests` of the pool at offload time, else None.
    """

    __slots__ = ("index_k", "digests")

    def __init__(self, kv: List[List[torch.Tensor]], index_k: List[List[torch.Tensor]],
                 digests: Optional[Dict[Tuple[str, int], int]] = None):
        super().__init__(kv)
        self.index_k = index_k
        self.digests = digests

    @property
    def kv(self) -> List[List[torch.Tensor]]:
        return list(self)

    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self for t in layer) + sum(t.nbytes for layer in self.index_k for t in layer)


# -- verified retract/resume (SGLANG_DISAGG_EXT_VERIFY=1) -------------------------------------
# The request's KV rows and index-key pages are digested (``core.digest``, on the pool's device) where
# they are when offloaded and again where the resume put them; each item is placed by its position in
# the request, so the two agree exactly when every byte came back to its place. A resume has no failure
# path in SGLang (``load_cpu_copy`` returns nothing and the scheduler goes on), so a mismatch is logged
# naming the component and layer and counted; it cannot fail the request.

_RETRACT_COMPONENTS = {"kv": dg.KV_COMPONENT, "index_k": dg.STATE_COMPONENT_BASE}


def _byte_rows(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.uint8).reshape(buf.shape[0], -1)


def retract_digests(pool, indices, with_index_k: bool = True) -> Dict[Tuple[str, int], int]:
    """``{(component, layer): digest}`` of the request's KV rows under token ``indices`` and
    (``with_index_k``) its index-key pages, each item placed at its position in the request."""
    rows = torch.as_tensor(indices).to(dtype=torch.int64)
    pages = torch.as_tensor(page_starts(indices, pool.page_size)).to(dtype=torch.int64)
    keys, requests = [], []
    for layer in range(pool.layer_num):
        keys.append(("kv", layer))
        requests.append((_byte_rows(pool.kv_buffer[layer]), _RETRACT_COMPONENTS["kv"], layer,
                         np.arange(rows.numel()), rows))
        if with_index_k:
            keys.append(("index_k", layer))
            requests.append((_byte_rows(pool.index_k_with_scale_buffer[layer]), _RETRACT_COMPONENTS["index_k"],
                             layer, np.arange(pages.numel()), pages))
    return dict(zip(keys, rows_digests(requests)))


def check_resume(offloaded: Dict[Tuple[str, int], int], resumed: Dict[Tuple[str, int], int]) -> bool:
    """Compare the offload's digests with the resume's; log and count each mismatch. True if all agree."""
    bad = [key for key in offloaded if resumed.get(key) != offloaded[key]]
    for component, layer in bad:
        metrics.count("verify_mismatches_total", component=f"retract_{component}")
        logger.error(
            "sglang-disagg-ext verified retract: the resumed request's %s layer %d differs from what was "
            "offloaded (digest 0x%016x offloaded, 0x%016x after resume)",
            component, layer, offloaded[(component, layer)], resumed.get((component, layer), 0),
        )
    metrics.count("verified_transfers_total", result="retract_mismatch" if bad else "retract_ok")
    return not bad


def _split_cpu_copy(value) -> Tuple[Sequence, Optional[Sequence]]:
    """(kv chunks, index-key chunks or None) from any offload value we may be handed."""
    if isinstance(value, NSACpuCopy):
        return value, value.index_k
    if isinstance(value, dict) and "kv" in value:  # upstream 0.5.12+ layout
        return value["kv"], value.get("index_k")
    return value, None  # the base layout: made before the fix was installed


_warned_plain_copy = False


# --------------------------------------------------------------------------
# Fixed methods
# --------------------------------------------------------------------------


def offload_index_k(pool, indices) -> List[List[torch.Tensor]]:
    """Host copy of the index-key pages under token ``indices``: per layer, in whole-page chunks."""
    pages = page_starts(indices, pool.page_size)
    rows = page_chunk_rows(pool.cpu_offloading_chunk_size, pool.page_size)
    return offload_rows(pool.index_k_with_scale_buffer, pages, rows, pool.layer_num)


def restore_index_k(pool, index_k: Sequence[Sequence[torch.Tensor]], indices) -> None:
    """Write :func:`offload_index_k` chunks back to the pages under token ``indices``."""
    pages = page_starts(indices, pool.page_size)
    restore_rows(pool.index_k_with_scale_buffer, index_k, pages, pool.layer_num, "index_k_with_scale_buffer")


def nsa_get_cpu_copy(self, indices, mamba_indices=None, **kwargs):
    """Offload the request's KV rows and index-key pages to the host.

    Same arguments as the base class in every release; ``mamba_indices`` and
    other keywords are accepted and unused (an NSA pool holds no Mamba state;
    the hybrid pool that does offloads it itself).

    Contract: decode scheduler thread, retract path only: ``ScheduleBatch.release_req``
    (``retract_decode``) -> ``Req.offload_kv_cache`` -> the allocator, with the
    request's token slots ``req_to_token[req_pool_idx, :seqlen - 1]`` while they
    still hold its data; the caller frees them right after return. So every
    host copy must be complete on return, and the pool's buffers are only
    read. The value is opaque to SGLang (kept as ``req.kv_cache_cpu``).
    """
    device = _pool_device(self)
    synchronize_device(device)  # writes of the last forward pass must land first
    kv = offload_rows(self.kv_buffer, indices, self.cpu_offloading_chunk_size, self.layer_num)
    index_k = offload_index_k(self, indices)
    # With verification on, what the request's rows and pages hold now, to check the resume against.
    digests = retract_digests(self, indices) if verification.enabled() else None
    synchronize_device(device)  # host copies complete before the caller frees the slots
    metrics.count("retract_offloads_total")
    return NSACpuCopy(kv, index_k, digests)


def nsa_load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, **kwargs):
    """Restore what :func:`nsa_get_cpu_copy` offloaded into the request's new slots.

    Contract: decode scheduler thread, from ``DecodePreallocQueue.resume_retracted_reqs``
    -> ``Req.load_kv_cache`` after ``_pre_alloc`` gave the request new slots
    (``indices``); ``kv_cache_cpu`` is what an offload
    returned, possibly stock's layout if made before install. Write only those
    slots' rows and pages, finish before return (the caller then drops the
    host copy), and keep accepting the base class's call signature.
    """
    global _warned_plain_copy
    kv, index_k = _split_cpu_copy(kv_cache_cpu)
    device = _pool_device(self)
    synchronize_device(device)
    restore_rows(self.kv_buffer, kv, indices, self.layer_num, "kv_buffer")
    if index_k is None:
        if not _warned_plain_copy:
            _warned_plain_copy = True
            logger.warning(
                "sglang-disagg-ext F5: restoring an NSA offload made without the index-key "
                "buffer (offloaded before the fix was installed); index keys not restored"
            )
    else:
        restore_index_k(self, index_k, indices)
    synchronize_device(device)  # host chunks stay alive until the copies are done
    offloaded = kv_cache_cpu.digests if isinstance(kv_cache_cpu, NSACpuCopy) else None  # ours, verified
    if offloaded is not None:
        check_resume(offloaded, retract_digests(self, indices, with_index_k=index_k is not None))


def _nsa_clear_buffers(self):
    """Release ``kv_buffer`` (base class) and ``index_k_with_scale_buffer``.

    Contract: no SGLang code in 0.5.10.post1 / 0.5.11 / 0.5.12.x calls
    ``_clear_buffers`` (only the pools define it); it is kept equal to what a
    caller tearing the pool down would expect: both buffers gone, nothing else
    touched, and safe when the index buffer is already absent.
    """
    cls = _nsa_pool_class()
    super(cls, self)._clear_buffers()
    if "index_k_with_scale_buffer" in self.__dict__:
        del self.index_k_with_scale_buffer


def metadata_get_buf(self, idx: int):
    """The release's own ``get_buf`` fields, each one a copy instead of a view.

    Contract: decode scheduler thread, from ``DecodeTransferQueue._commit_transfer_to_req``
    (``pop_transferred``) after the room polled Success, with the request's
    ``metadata_buffer_index``. Returns the same tuple shape and field order as
    the release's ``get_buf``; never writes the buffers (``pop_transferred``
    then frees the slot for reuse by other requests; the copies stay valid).
    """
    original = _original_callable(_metadata_buffers_class(), "get_buf")
    # Later releases return None for fields that are switched off; keep those.
    return tuple(None if t is None else t.clone() for t in original(self, idx))


# --------------------------------------------------------------------------
# Install / uninstall
# --------------------------------------------------------------------------


def _import_attr(module: str, name: str) -> Optional[type]:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        logger.warning("sglang-disagg-ext F5: cannot import %s (%s); %s not patched", module, e, name)
        return None
    return getattr(mod, name)  # every release defines the classes asked for here


def _nsa_pool_class() -> Optional[type]:
    try:
        return releases.nsa_pool_class()
    except ImportError as e:
        logger.warning("sglang-disagg-ext F5: cannot import SGLang's memory pools (%s); NSATokenToKVPool not patched", e)
        return None


def _metadata_buffers_class() -> Optional[type]:
    return _import_attr("sglang.srt.disaggregation.utils", "MetadataBuffers")


def _original_callable(cls: type, name: str):
    """The stock implementation of ``cls.name`` (own or inherited), as a plain function."""
    value = _originals.get((cls, name), _MISSING)
    if value is _MISSING:
        value = cls.__dict__.get(name, _MISSING)
        if getattr(value, _EXT_MARK, False):
            value = _MISSING
    if value is not _MISSING:
        return value
    for base in cls.__mro__[1:]:
        if name in base.__dict__:
            return base.__dict__[name]
    raise AttributeError(f"{cls.__name__}.{name}")


def stock_callable(cls: type, name: str):
    """SGLang's own ``cls.name`` (defined on ``cls`` or inherited), whether or not the hooks are installed."""
    return _original_callable(cls, name)


def _mark(fn, name: str):
    setattr(fn, _EXT_MARK, name)
    return fn


_mark(nsa_get_cpu_copy, "F5")
_mark(nsa_load_cpu_copy, "F5")
_mark(_nsa_clear_buffers, "F5")
_mark(metadata_get_buf, "F5")


def _targets() -> List[Tuple[type, str, object]]:
    targets = []
    nsa = _nsa_pool_class()
    if nsa is not None:
        targets += [
            (nsa, "get_cpu_copy", nsa_get_cpu_copy),
            (nsa, "load_cpu_copy", nsa_load_cpu_copy),
            (nsa, "_clear_buffers", _nsa_clear_buffers),
        ]
    meta = _metadata_buffers_class()
    if meta is not None:  # every release's MetadataBuffers has get_buf
        targets.append((meta, "get_buf", metadata_get_buf))
    return targets


def install_retract_fixes() -> List[str]:
    """Install the F5 fixes on the SGLang classes that exist here. Idempotent.

    Returns ``Class.method`` for every hook in place after the call. The
    caller decides *whether* to install (``releases.current_policy().is_live("F5")``);
    this function only patches what the installed release has.
    """
    installed = []
    for cls, name, fn in _targets():
        current = cls.__dict__.get(name, _MISSING)
        if current is not fn:
            _originals.setdefault((cls, name), current)
            setattr(cls, name, fn)
        installed.append(f"{cls.__name__}.{name}")
    if installed:
        logger.debug("sglang-disagg-ext F5 hooks: %s", ", ".join(installed))
    return installed


def uninstall_retract_fixes() -> None:
    """Put back exactly what the classes held before :func:`install_retract_fixes`."""
    for (cls, name), original in list(_originals.items()):
        if original is _MISSING:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, original)
    _originals.clear()


def retract_fixes_installed() -> bool:
    targets = _targets()
    return bool(targets) and all(cls.__dict__.get(name) is fn for cls, name, fn in targets)


@contextlib.contextmanager
def retract_fixes(enabled: bool = True):
    """A block with the F5 hooks in (``enabled``) or stock code; what was there is restored after."""
    with hooks.toggled(enabled, retract_fixes_installed, install_retract_fixes, uninstall_retract_fixes):
        yield
