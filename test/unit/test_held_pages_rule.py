"""F21's rule (core.held_pages) and the endpoint look that decides "prefill gone"; no SGLang.

Expected verdicts are read off the rule by hand: timeout 30 s, a room held since t=100 (monotonic).
"""

import socket

import pytest

from sglang_disagg_ext.backends.common import held_pages
from sglang_disagg_ext.backends.common.held_pages import endpoints_refuse
from sglang_disagg_ext.core.held_pages import LIMIT_ENV, Verdict, abort_resend_due, parse_limit, verdict

pytestmark = pytest.mark.timeout(30)


def _v(now, *, drained=False, gone=False):
    return verdict(now=now, held_since=100.0, timeout_s=30.0, drained=drained, prefill_gone=gone)


@pytest.mark.parametrize("now, drained, gone, expected", [
    (129.9, False, False, Verdict.STOCK),  # before the timeout: stock's rule
    (130.0, False, False, Verdict.HOLD),  # at the timeout, silent, not gone: held
    (900.0, False, False, Verdict.HOLD),  # still silent: held, however long
    (900.0, True, False, Verdict.STOCK),  # acked: stock releases it as drained
    (130.0, False, True, Verdict.PEER_GONE),  # its process is gone: released
    (130.0, True, True, Verdict.STOCK),  # acked and gone: stock's drained release
    (120.0, False, True, Verdict.STOCK),  # gone, but before the timeout: stock's rule
])
def test_verdict(now, drained, gone, expected):
    assert _v(now, drained=drained, gone=gone) is expected


@pytest.mark.parametrize("now, limit, expected", [
    (159.9, 60.0, Verdict.HOLD), (160.0, 60.0, Verdict.LIMIT),  # 60 s from the hold's start
    (130.0, 10.0, Verdict.LIMIT),  # a limit under stock's timeout: at the timeout, never before
    (129.9, 10.0, Verdict.STOCK),
    (10_000.0, None, Verdict.HOLD),  # no limit: held
])
def test_verdict_with_the_operators_limit(now, limit, expected):
    assert verdict(now=now, held_since=100.0, timeout_s=30.0, drained=False, prefill_gone=False,
                   limit_s=limit) is expected
    # Proof outranks the limit: acked or gone is said as such.
    assert verdict(now=now, held_since=100.0, timeout_s=30.0, drained=False, prefill_gone=True,
                   limit_s=limit) in (Verdict.PEER_GONE, Verdict.STOCK)


@pytest.mark.parametrize("raw, value", [(None, None), ("", None), ("  ", None), ("90", 90.0), ("0.5", 0.5)])
def test_parse_limit(raw, value):
    assert parse_limit(raw) == value


@pytest.mark.parametrize("raw", ["0", "-3", "abc", "inf", "nan"])
def test_parse_limit_refuses(raw):
    with pytest.raises(ValueError, match=LIMIT_ENV):
        parse_limit(raw)


@pytest.mark.parametrize("now, last_sent, due", [
    (129.9, None, False), (130.0, None, True),  # one timeout after stock's ABORT at the hold's start
    (159.9, 130.0, False), (160.0, 130.0, True),  # then one per timeout period
])
def test_abort_resend_due(now, last_sent, due):
    assert abort_resend_due(now=now, held_since=100.0, timeout_s=30.0, last_sent=last_sent) is due


def test_endpoints_refuse_only_when_every_one_refuses():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # bound, then closed: nothing listens there
    try:
        open_ = ("127.0.0.1", listening.getsockname()[1])
        gone = ("127.0.0.1", closed_port)
        assert endpoints_refuse([gone]) is True
        assert endpoints_refuse([gone, gone]) is True
        assert endpoints_refuse([gone, open_]) is False  # one rank still has its socket: a writer may live
        assert endpoints_refuse([open_]) is False
        assert endpoints_refuse([]) is False  # nothing looked at proves nothing
    finally:
        listening.close()


def test_the_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "90")
    assert held_pages.limit_s() == 90.0 and held_pages.invalid_setting() is None
    monkeypatch.setenv(LIMIT_ENV, "soon")
    assert held_pages.limit_s() is None  # unreadable: held until confirmed; doctor names it
    assert LIMIT_ENV in held_pages.invalid_setting()
    monkeypatch.delenv(LIMIT_ENV)
    assert held_pages.limit_s() is None and held_pages.invalid_setting() is None
