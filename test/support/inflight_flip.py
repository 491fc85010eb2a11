"""Test-only prefill hook (``SGLANG_HARNESS_PREFILL_HOOK``): one source byte wrong while the engine reads it.

``flip_one_source_byte(mgr)`` shadows ``mgr.engine.batch_transfer_sync`` (the
Mooncake engine call every ``_transfer_data`` ends in) on the prefill
manager's engine. On the first call that writes from the chosen source buffer,
it flips one byte of that buffer's first block (XOR 0xFF) just before the
engine runs and restores it right after: the engine writes the wrong byte to
decode, prefill's own pool is intact afterwards, and anything that read the
source before the engine (the ``-ext`` digest) saw the right byte. This is the
narrowest place a byte can go wrong "in flight" without touching SGLang or the
plugin. Stock and ``-ext`` managers get the same fault at the same call.

Environment (set by the test):

* ``SGLANG_HARNESS_FLIP_COMPONENT``: ``kv`` (default), ``aux`` or ``state<i>``;
* ``SGLANG_HARNESS_FLIP_BUFFER``: buffer index within it (default 0);
* ``SGLANG_HARNESS_FLIP_OFFSET``: byte offset in the block (default 1).

Pool pointers come from ``mgr.kv_args`` (the ones SGLang registered). CPU pools only.
It lives here, outside the wheel.
"""

import ctypes
import os
import threading


def _buffer(kv_args, component: str, index: int):
    if component == "kv":
        return kv_args.kv_data_ptrs[index], kv_args.kv_data_lens[index]
    if component == "aux":
        return kv_args.aux_data_ptrs[index], kv_args.aux_data_lens[index]
    if component.startswith("state"):
        c = int(component[len("state"):])
        ptrs, lens = kv_args.state_data_ptrs, kv_args.state_data_lens
        if ptrs and isinstance(ptrs[0], (list, tuple)):  # per component (0.5.12+)
            ptrs, lens = ptrs[c], lens[c]
        elif c != 0:
            raise ValueError(f"flat state layout has one component, not {component}")
        return ptrs[index], lens[index]
    raise ValueError(f"SGLANG_HARNESS_FLIP_COMPONENT={component!r}: kv, aux or state<i>")


def flip_one_source_byte(mgr) -> None:
    component = os.environ.get("SGLANG_HARNESS_FLIP_COMPONENT", "kv")
    index = int(os.environ.get("SGLANG_HARNESS_FLIP_BUFFER", "0"))
    offset = int(os.environ.get("SGLANG_HARNESS_FLIP_OFFSET", "1"))
    start, nbytes = _buffer(mgr.kv_args, component, index)
    engine, stock = mgr.engine, mgr.engine.batch_transfer_sync
    fired = threading.Event()

    def batch_transfer_sync(session_id, src_addrs, dst_addrs, lengths, *args, **kwargs):
        target = None
        if not fired.is_set():
            for src, length in zip(src_addrs, lengths):
                if start <= src < start + nbytes and offset < length:
                    target = src + offset
                    break
        if target is None:
            return stock(session_id, src_addrs, dst_addrs, lengths, *args, **kwargs)
        fired.set()
        byte = ctypes.c_uint8.from_address(target)
        original = byte.value
        byte.value = original ^ 0xFF
        try:
            return stock(session_id, src_addrs, dst_addrs, lengths, *args, **kwargs)
        finally:
            byte.value = original

    engine.batch_transfer_sync = batch_transfer_sync
