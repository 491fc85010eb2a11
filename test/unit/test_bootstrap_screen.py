"""F15's pure rules (``core/bootstrap_screen.py``): which messages stock's NIXL bootstrap loop dies of.

The parsers stand in for stock's ``KVArgsRegisterInfo.from_zmq`` / ``TransferInfo.from_zmq``: they
record what they were given and raise where told, so each case states by hand what the screen hands
them (the message without its guard frame, as stock's loop does) and what it answers.
"""

import struct

import pytest

from sglang_disagg_ext.core.bootstrap_screen import MIN_FRAMES, Rejection, screen

GUARD = b"NixlMsgGuard"
PASSED = (b"WATERMARK", b"STAGING_RSP")


class Parser:
    def __init__(self, raises=None):
        self.raises = raises
        self.calls = []

    def __call__(self, frames):
        self.calls.append(frames)
        if self.raises is not None:
            raise self.raises
        return object()


def _screen(msg, registration=None, request=None, handles_abort=True):
    registration = registration or Parser()
    request = request or Parser()
    return screen(msg, GUARD, PASSED, handles_abort, registration, request), registration, request


@pytest.mark.timeout(10)
def test_a_well_formed_request_and_registration_pass_to_their_parser():
    req = [GUARD, b"1000", b"127.0.0.1", b"17000", b"decode-agent", b"\x01\x00\x00\x00"]
    verdict, registration, request = _screen(req)
    assert verdict is None
    assert request.calls == [req[1:]] and registration.calls == []
    reg = [GUARD, b"None", b"127.0.0.1", b"17000", b"decode-agent", struct.pack("Q", 4096)]
    verdict, registration, request = _screen(reg)
    assert verdict is None
    assert registration.calls == [reg[1:]] and request.calls == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize("msg", [[b"WATERMARK", b"x"], [b"STAGING_RSP"], [b"ABORT", b"1000"],
                                 [b"ABORT", b"-3", b"more"]])
def test_messages_stock_handles_before_its_guard_pass_untouched(msg):
    verdict, registration, request = _screen(msg)
    assert verdict is None and registration.calls == [] and request.calls == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize("msg,kind", [
    ([], "empty"),
    ([b"GET / HTTP/1.1"], "foreign"),
    ([b"nixlmsgguard", b"1000", b"a", b"b", b"c"], "foreign"),  # the guard is compared as bytes
    ([b"ABORT"], "abort"),
    ([b"ABORT", b"room"], "abort"),
    ([GUARD], "short"),
    ([GUARD, b"1000", b"a", b"b"], "short"),  # MIN_FRAMES - 1
    ([GUARD, b"1000", b"a", b"b", b"\xff"], "malformed"),  # agent name not ASCII
    ([GUARD, b"ro\xffom", b"a", b"b", b"agent"], "malformed"),
    ([GUARD, b"1e3", b"a", b"b", b"agent"], "malformed"),
])
def test_what_stock_dies_of_is_rejected_by_kind_without_parsing(msg, kind):
    verdict, registration, request = _screen(msg)
    assert isinstance(verdict, Rejection) and verdict.kind == kind, verdict
    assert verdict.room is None
    assert registration.calls == [] and request.calls == []


@pytest.mark.timeout(10)
def test_min_frames_is_what_stock_indexes():
    # GUARD, room, endpoint, port, agent name: stock reads frame 3 after dropping the guard.
    assert MIN_FRAMES == 5


@pytest.mark.timeout(10)
def test_a_registration_its_parser_cannot_read_is_rejected_with_the_parsers_error():
    msg = [GUARD, b"None", b"127.0.0.1", b"17000", b"decode-7"]
    verdict, registration, _ = _screen(msg, registration=Parser(IndexError("list index out of range")))
    assert verdict == Rejection("registration", "a registration that does not parse: IndexError: list index out "
                                "of range", None, "decode-7")
    assert registration.calls == [msg[1:]]


@pytest.mark.timeout(10)
def test_a_request_its_parser_cannot_read_names_its_room_and_sender():
    msg = [GUARD, b"1042", b"127.0.0.1", b"17000", b"decode-7", b"\x01\x02\x03"]
    verdict, _, request = _screen(msg, request=Parser(struct.error("unpack requires a buffer of 4 bytes")))
    assert verdict == Rejection("request", "room 1042's request that does not parse: error: unpack requires a "
                                "buffer of 4 bytes", 1042, "decode-7")
    assert request.calls == [msg[1:]]


@pytest.mark.timeout(10)
def test_an_abort_is_foreign_where_stocks_loop_does_not_take_aborts():
    # Up to 0.5.15 stock's loop asserts the guard on every message (F13's filter takes decode's
    # ABORT before it on 0.5.13-0.5.15; up to 0.5.12.x no decode sends one).
    verdict, _, _ = _screen([b"ABORT", b"1000"], handles_abort=False)
    assert verdict is not None and verdict.kind == "foreign" and verdict.room is None
