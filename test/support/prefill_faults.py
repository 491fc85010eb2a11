"""Test-only manager hooks: one manager method raises once, for one room.

Prefill hooks go in ``SGLANG_HARNESS_PREFILL_HOOK``; ``raise_on_status_success`` and
``raise_on_failure_record`` are decode hooks (``SGLANG_HARNESS_DECODE_MANAGER_HOOK``).

Loaded by the harness worker in the prefill process right after the manager
exists (``worker._run_prefill_hook``); each hook shadows one method on that
manager instance, so stock and ext managers get the same fault at the same
call. ``SGLANG_HARNESS_FAULT_ROOM`` names the room (default 1000, the first
request's). It lives here, outside the wheel.
"""

import os
import threading

FAULT_ROOM_ENV = "SGLANG_HARNESS_FAULT_ROOM"


class InjectedFault(Exception):
    """The exception the hooks raise (its name and text are what the tests look for)."""


def _room() -> int:
    return int(os.environ.get(FAULT_ROOM_ENV, "1000"))


def _once():
    fired = threading.Event()

    def take() -> bool:
        if fired.is_set():
            return False
        fired.set()
        return True

    return take


def raise_in_send_aux(mgr) -> None:
    """The transfer worker's ``send_aux`` call for the room raises (after its KV pages went out)."""
    room, take, stock = _room(), _once(), mgr.send_aux

    def send_aux(req, *args, **kwargs):
        if req.room == room and take():
            raise InjectedFault(f"injected fault: send_aux for room {room}")
        return stock(req, *args, **kwargs)

    mgr.send_aux = send_aux


FAULT_AUX_INDEX_ENV = "SGLANG_HARNESS_FAULT_AUX_INDEX"


def raise_in_nixl_send_aux(mgr) -> None:
    """NIXL: the transfer worker's ``send_aux`` raises once for one prefill aux row (after the
    room's KV handles were posted). NIXL's ``send_aux(peer_name, prefill_aux_index, ...)`` names
    no room, so the row does: ``SGLANG_HARNESS_FAULT_AUX_INDEX`` (default 1, room 1000's row in
    ``scenarios.nixl_newest.listener_fault``)."""
    row, take, stock = int(os.environ.get(FAULT_AUX_INDEX_ENV, "1")), _once(), mgr.send_aux

    def send_aux(peer_name, prefill_aux_index, *args, **kwargs):
        if prefill_aux_index == row and take():
            raise InjectedFault(f"injected fault: send_aux for aux row {row}")
        return stock(peer_name, prefill_aux_index, *args, **kwargs)

    mgr.send_aux = send_aux


def raise_on_waiting_for_input(mgr) -> None:
    """The bootstrap thread's ``update_status(room, WaitingForInput)`` raises: decode's
    pre-alloc message for the room is registered, the handler fails before the room is ready.
    On MoRI (every release) the call is the last step of ``_handle_transfer_message``."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room, take, stock = _room(), _once(), mgr.update_status

    def update_status(bootstrap_room, status, *args, **kwargs):
        if bootstrap_room == room and status == KVPoll.WaitingForInput and take():
            raise InjectedFault(f"injected fault: bootstrap message handler for room {room}")
        return stock(bootstrap_room, status, *args, **kwargs)

    mgr.update_status = update_status


def raise_in_registration(mgr) -> None:
    """The bootstrap thread's registration of decode TP rank 0 raises, once, inside stock
    ``_add_remote_peer`` (at its ``_prepare_payload_xfer`` call: NIXL 0.5.22+); other ranks register."""
    take, stock = _once(), mgr._prepare_payload_xfer

    def prepare_payload_xfer(peer_info, *args, **kwargs):
        if peer_info.decode_tp_rank == 0 and take():
            raise InjectedFault(f"injected fault: registration of decode TP rank {peer_info.decode_tp_rank}")
        return stock(peer_info, *args, **kwargs)

    mgr._prepare_payload_xfer = prepare_payload_xfer


def raise_on_status_success(mgr) -> None:
    """Decode: ``update_status(room, Success)`` raises once. On NIXL 0.5.23 that call comes
    from ``apply_prefill_status`` on the decode listener thread, handling prefill's Success
    message for the room (``KV_STATUS``); any earlier status of the room passes."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room, take, stock = _room(), _once(), mgr.update_status

    def update_status(bootstrap_room, status, *args, **kwargs):
        if bootstrap_room == room and status == KVPoll.Success and take():
            raise InjectedFault(f"injected fault: decode status handler for room {room}")
        return stock(bootstrap_room, status, *args, **kwargs)

    mgr.update_status = update_status


def raise_on_failure_record(mgr) -> None:
    """Decode: ``record_failure(room, ...)`` raises once. On NIXL (0.5.22, 0.5.23) that call comes
    from ``apply_prefill_status`` on the decode listener thread, handling prefill's Failed
    message for the room (``KV_STATUS``): the one way a NIXL decode learns of a prefill-side
    failure on every release that has the listener."""
    room, take, stock = _room(), _once(), mgr.record_failure

    def record_failure(bootstrap_room, *args, **kwargs):
        if bootstrap_room == room and take():
            raise InjectedFault(f"injected fault: decode failure handler for room {room}")
        return stock(bootstrap_room, *args, **kwargs)

    mgr.record_failure = record_failure


def lose_first_transfer(mgr) -> None:
    """Prefill: the fault room's chunks never reach a transfer worker (``add_transfer_request``
    returns without queuing them), as a lost transfer would: nothing fails on prefill, and decode
    ends the room by its waiting timeout, which sends SGLang's ``ABORT`` message to prefill's
    bootstrap socket (0.5.13 common/conn.py:1082-1087, 1114-1126)."""
    room, stock = _room(), mgr.add_transfer_request

    def add_transfer_request(bootstrap_room, *args, **kwargs):
        if bootstrap_room == room:
            return None
        return stock(bootstrap_room, *args, **kwargs)

    mgr.add_transfer_request = add_transfer_request


# What ``send_bad_bootstrap_messages`` sends, one message of each kind stock's NIXL bootstrap loop
# dies of (0.5.23 nixl/conn.py:3379-3395), and the reason label F15 counts each under.
NIXL_GUARD = b"NixlMsgGuard"
BAD_BOOTSTRAP_MESSAGES = (
    ("foreign", [b"GET / HTTP/1.1\r\nHost: prefill\r\n\r\n"]),  # first frame not GUARD: AssertionError
    ("short", [NIXL_GUARD, b"1000"]),  # frames [3] read: IndexError
    ("malformed", [NIXL_GUARD, b"room-7", b"127.0.0.1", b"1", b"stray-agent"]),  # int(room): ValueError
    ("registration", [NIXL_GUARD, b"None", b"127.0.0.1", b"1", b"stray-agent", b"\x01\x02\x03"]),  # from_zmq
)


def send_bad_bootstrap_messages(mgr) -> None:
    """NIXL prefill: before any decode registers, one message of each kind in
    ``BAD_BOOTSTRAP_MESSAGES`` arrives on the manager's own bootstrap socket, from a PUSH socket
    of this hook's (as another service or a peer of another version would send them). Returns
    when ZMQ has delivered them (``Context.term`` waits for the queued messages)."""
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"tcp://{mgr.local_ip}:{mgr.rank_port}")
        for _, frames in BAD_BOOTSTRAP_MESSAGES:
            sock.send_multipart(frames)
        sock.close(linger=10_000)
    finally:
        ctx.term()
