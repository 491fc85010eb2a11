"""Test-only faults inside a real prefill server's Mooncake transfers, armed from the test.

``sitecustomize`` installs this where ``SGLANG_E2E_FAULT_DIR`` is set (the real-server tests
set it for prefill only). Every Mooncake manager built afterwards, stock or ``-ext`` (the
``-ext`` classes subclass SGLang's), gets its engine's ``batch_transfer_sync`` shadowed -- the
call every Mooncake KV write ends in, so stock and ``-ext`` meet the same fault at the same call.

The test arms one fault by writing a file into that folder; the next transfer call that can
take it consumes the file (renamed to ``fired-<fault>``, so the test sees it fired):

* ``corrupt-kv-page``: while the engine reads it, the first page of the call's first block
  from KV buffer 0 has every bf16 value's sign flipped (XOR 0x80 on each odd byte), restored
  right after the call: decode receives one wrong page, prefill's pool stays right, and a
  digest taken before the engine saw the right bytes;
* ``fail-write``: the call writes nothing and returns -1, as the engine does when a write fails;
* ``hold-write``: the call waits until the test writes ``release-hold-write`` (at most
  ``HOLD_MAX_S``), then writes as stock does: the request stays in transfer on both servers
  (prefill's sender and decode's receiver live) for as long as the test needs.
"""

import ctypes
import os
import threading
import time

FAULTS = ("corrupt-kv-page", "fail-write", "hold-write")
HOLD_MAX_S = 60.0

_mu = threading.Lock()


def _take(fault_dir: str, fault: str) -> bool:
    """Consume an armed ``fault`` (atomically: one transfer call takes it)."""
    armed = os.path.join(fault_dir, fault)
    if not os.path.exists(armed):
        return False
    with _mu:
        try:
            os.rename(armed, os.path.join(fault_dir, f"fired-{fault}"))
        except FileNotFoundError:
            return False
    return True


def _shadow(mgr, fault_dir: str) -> None:
    engine = mgr.engine
    stock = engine.batch_transfer_sync
    kv_start, kv_len = mgr.kv_args.kv_data_ptrs[0], mgr.kv_args.kv_data_lens[0]
    page_len = mgr.kv_args.kv_item_lens[0]

    def batch_transfer_sync(session_id, src_addrs, dst_addrs, lengths, *args, **kwargs):
        if _take(fault_dir, "fail-write"):
            return -1
        if _take(fault_dir, "hold-write"):
            deadline = time.monotonic() + HOLD_MAX_S
            while not os.path.exists(os.path.join(fault_dir, "release-hold-write")) and time.monotonic() < deadline:
                time.sleep(0.05)
        block = next((i for i, src in enumerate(src_addrs) if kv_start <= src < kv_start + kv_len), None)
        if block is None or not _take(fault_dir, "corrupt-kv-page"):
            return stock(session_id, src_addrs, dst_addrs, lengths, *args, **kwargs)
        nbytes = min(page_len, lengths[block])
        page = (ctypes.c_uint8 * nbytes).from_address(src_addrs[block])
        original = bytes(page)
        for i in range(1, nbytes, 2):  # the high byte of each little-endian bf16 value
            page[i] ^= 0x80
        try:
            return stock(session_id, src_addrs, dst_addrs, lengths, *args, **kwargs)
        finally:
            ctypes.memmove(src_addrs[block], original, nbytes)

    engine.batch_transfer_sync = batch_transfer_sync


def install(conn_module) -> None:
    """Wrap ``MooncakeKVManager.__init__`` of SGLang's ``mooncake/conn.py`` (just imported)."""
    fault_dir = os.environ["SGLANG_E2E_FAULT_DIR"]
    cls = conn_module.MooncakeKVManager
    stock_init = cls.__init__

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        if getattr(self, "engine", None) is not None:
            _shadow(self, fault_dir)

    cls.__init__ = __init__
