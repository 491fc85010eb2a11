"""Test-only hooks: one byte wrong in flight (prefill: while the engine reads it) or as it lands (decode).

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


def _item_len(kv_args, component: str, index: int) -> int:
    if component == "kv":
        return kv_args.kv_item_lens[index]
    if component == "aux":
        return kv_args.aux_item_lens[index]
    c = int(component[len("state"):])
    lens = kv_args.state_item_lens
    if lens and isinstance(lens[0], (list, tuple)):
        lens = lens[c]
    return lens[index]


def flip_one_landed_byte(mgr) -> None:
    """Decode hook (``SGLANG_HARNESS_DECODE_MANAGER_HOOK``): one landed byte wrong.

    For engines whose writes the harness cannot catch mid-call (NIXL posts a
    transfer and completes it later, from descriptor lists), the byte goes wrong
    at the destination instead: ``mgr.apply_prefill_status`` is shadowed (where it exists), and on
    the ``SGLANG_HARNESS_FLIP_AFTER_SUCCESSES``-th Success a prefill rank reports
    (default 1; the test sets its prefill TP size) it flips (XOR 0xFF) byte
    ``SGLANG_HARNESS_FLIP_OFFSET`` of page ``SGLANG_HARNESS_FLIP_PAGE`` of the
    chosen decode buffer, then lets SGLang (and ``-ext``'s check, inside
    ``update_status``) handle the Success. The bytes landed right and were then
    changed before decode accepted them: what a bad DMA or a stray write would
    leave, and what prefill's digest (taken before the transfer existed) does not
    match. Same fault for stock and ``-ext`` at the same point. Where a NIXL decode concludes
    from notifications (``check_transfer_done``), it flips there instead (see below). CPU
    pools only."""
    component = os.environ.get("SGLANG_HARNESS_FLIP_COMPONENT", "kv")
    index = int(os.environ.get("SGLANG_HARNESS_FLIP_BUFFER", "0"))
    page = int(os.environ["SGLANG_HARNESS_FLIP_PAGE"])
    offset = int(os.environ.get("SGLANG_HARNESS_FLIP_OFFSET", "1"))
    start, nbytes = _buffer(mgr.kv_args, component, index)
    target = start + page * _item_len(mgr.kv_args, component, index) + offset
    if not start <= target < start + nbytes:
        raise ValueError(f"flip target page {page} offset {offset} outside {component} buffer {index}")
    # Several prefill ranks each write part of the page and report their own Success: flip at
    # the last one's, after every part landed (an earlier flip could be overwritten).
    successes = int(os.environ.get("SGLANG_HARNESS_FLIP_AFTER_SUCCESSES", "1"))
    seen, flipped = [], []
    lock = threading.Lock()

    def flip_once():
        if not flipped:
            flipped.append(1)
            byte = ctypes.c_uint8.from_address(target)
            byte.value ^= 0xFF

    def is_success(args, kwargs) -> bool:
        status = kwargs.get("status", args[1] if len(args) > 1 else None)
        return status is not None and int(status) == 4  # KVPoll.Success

    # Where SGLang hands each prefill rank's status to apply_prefill_status: flip at the
    # SUCCESSES-th. Where it does not (Mooncake up to 0.5.19 counts the ranks in its decode
    # thread; MoRI up to 0.5.19 in its worker), update_status(room, Success) comes once,
    # after the last rank: flip there. Whichever comes first flips, once.
    stock_apply = getattr(mgr, "apply_prefill_status", None)
    if stock_apply is not None:
        def apply_prefill_status(*args, **kwargs):
            if is_success(args, kwargs):
                with lock:
                    seen.append(1)
                    if len(seen) == successes:
                        flip_once()
            return stock_apply(*args, **kwargs)

        mgr.apply_prefill_status = apply_prefill_status
    stock_update = mgr.update_status

    def update_status(*args, **kwargs):
        if is_success(args, kwargs):
            with lock:
                flip_once()
        return stock_update(*args, **kwargs)

    mgr.update_status = update_status

    # Where the decode concludes a room from NIXL notifications (NIXL up to 0.5.22:
    # NixlKVReceiver.poll asks check_transfer_done right after draining them), flip when
    # stock's TransferStatus first says done and not failed: every notification of the room
    # arrived, so all its bytes landed. -ext's check runs inside check_transfer_done, after.
    stock_done = getattr(mgr, "check_transfer_done", None)
    statuses = getattr(mgr, "transfer_statuses", None)
    if stock_done is not None and isinstance(statuses, dict):
        def check_transfer_done(room, *args, **kwargs):
            status = statuses.get(room)
            # is_failure: up to 0.5.12.x (a prefill rank's failure notice); later releases fail
            # a room through check_status, before poll asks this.
            if status is not None and status.is_done() and not getattr(status, "is_failure", False):
                with lock:
                    flip_once()
            return stock_done(room, *args, **kwargs)

        mgr.check_transfer_done = check_transfer_done
