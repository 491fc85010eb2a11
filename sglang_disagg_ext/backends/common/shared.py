"""Small pieces two or more adapters share, with no SGLang import.

* :func:`report_trim`: a state-page list cut to its counterpart's length (F1 on
  Mooncake, F11 on NIXL) is counted in ``state_trims_total`` and logged, one
  WARNING per component and kind a minute (it repeats on every request of an
  affected model), naming how many were not logged in between.
* :func:`probe_prefill_version`: an ``-ext`` decode asks the prefill's
  bootstrap server (an extra HTTP route the ``-ext`` prefill adds) which
  version of a plugin wire it speaks (MoRI F3 state wire, F12 metadata order).
* :func:`note_peer_bounds`: prefill notes the pool sizes a decode registration
  published in its trailing frame (Mooncake F6/F9, NIXL destination bounds), or
  that a stock decode published none (said once per peer).
* :func:`pool_bounds_frame`: what a decode publishes (Mooncake F6/F9 with its
  state pools, NIXL without), with its compatibility record (F18, :func:`own_peer_record`).
* :class:`FilteringSocket` / :class:`FrameAppendingSocket`: where a release
  gives the manager no hook around a message (the decode registration, the
  status message), the socket stock reads or sends it through is wrapped, so
  the plugin's trailing frame is added on one side and read (or taken off) on
  the other before stock's code parses the message by position.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Tuple

from sglang_disagg_ext import metrics
from sglang_disagg_ext.core import peer_record
from sglang_disagg_ext.core.index_bounds import IndexBoundsError, bounds_in_message, bounds_of, encode_frame
from sglang_disagg_ext.core.rate_limit import EveryInterval

_TRIMS_LOGGED = EveryInterval(60.0)


def report_trim(plan, logger: logging.Logger) -> None:
    """Count and log one trim; ``plan`` is a ``core.state_plan.ComponentPlan``."""
    metrics.count("state_trims_total", component=plan.component, kind=plan.kind)
    held = _TRIMS_LOGGED.admit((plan.component, plan.kind))
    if held is None:
        logger.debug(plan.describe_trim())
    elif held:
        logger.warning("%s (%d more trims of this component in the last %.0f s not logged)",
                       plan.describe_trim(), held, _TRIMS_LOGGED.interval_s)
    else:
        logger.warning(plan.describe_trim())


def probe_prefill_version(bootstrap_addr: str, route: str, key: str, timeout_s: float,
                          logger: logging.Logger) -> Tuple[bool, Optional[object]]:
    """GET ``http://<bootstrap_addr><route>`` and read ``key`` of its JSON answer.

    Returns ``(False, None)`` where there is no definite answer yet (unreachable,
    an unexpected status: logged, ask again later), ``(True, None)`` for a 404 (a
    stock prefill: the route is the ``-ext`` prefill's), ``(True, version)`` for a
    200 (``version`` None when the answer has no such key).
    """
    import requests

    url = f"http://{bootstrap_addr}{route}"
    try:
        response = requests.get(url, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - unreachable: SGLang's own checks report it
        logger.warning("cannot ask %s for %s (%s); asking again next request", url, key, exc)
        return False, None
    if response.status_code == 404:
        return True, None
    if response.status_code != 200:
        logger.warning("%s answered %s; asking again next request", url, response.status_code)
        return False, None
    try:
        return True, response.json().get(key)
    except Exception:  # noqa: BLE001 - an answer that is not JSON: no version
        return True, None


def pool_bounds_frame(kv_args, logger: logging.Logger, state: bool = True,
                      reads_digests: bool = False, mgr=None) -> Optional[bytes]:
    """Decode's KV and aux pool sizes (and, with ``state``, its state pools') as one
    trailing registration frame; None (and one error line on ``logger``) if they cannot
    be read: the registration still goes out, the peer then runs unchecked.
    ``reads_digests``: this decode verifies transfers (``PoolBounds.reads_digests``).
    The frame also carries this side's compatibility record (F18, :func:`own_peer_record` of
    ``mgr``, the decode's manager, where given).

    Per-component layout (0.5.12+): ``state_data_lens[c]`` lists component ``c``'s
    buffers. Flat layout (0.5.10.post1, 0.5.11): one state component of
    ``kv_args.state_type``, its buffers listed directly.
    """
    state_data = list(getattr(kv_args, "state_data_lens", None) or []) if state else []
    state_item = list(getattr(kv_args, "state_item_lens", None) or []) if state else []
    if state_data and not isinstance(state_data[0], (list, tuple)):
        state_data, state_item = [state_data], [state_item]
    try:
        bounds = bounds_of(kv_args.kv_data_lens, kv_args.kv_item_lens, kv_args.aux_data_lens,
                           kv_args.aux_item_lens, state_data, state_item)
    except (IndexBoundsError, AttributeError, TypeError) as exc:
        logger.error("not publishing pool sizes to prefill: %s", exc)
        return None
    if mgr is not None:
        bounds = dataclasses.replace(bounds, peer=own_peer_record(mgr))
    return encode_frame(dataclasses.replace(bounds, reads_digests=True) if reads_digests else bounds)


def own_peer_record(mgr) -> dict:
    """This side's F18 compatibility record (``core.peer_record``) from its manager's ``KVArgs``;
    fields SGLang did not set are left out (the peer then does not compare them)."""
    from sglang_disagg_ext import __version__, releases

    kv_args = mgr.kv_args
    server_args = getattr(mgr, "server_args", None)
    # HiSparse (decode host pages of one token) and decode context parallel (re-laid-out
    # pages) move KV in another layout than equal whole pages: nothing to compare.
    page_for_page = not getattr(server_args, "enable_hisparse", False) and (getattr(mgr, "dcp_size", 1) or 1) <= 1
    return peer_record.record(
        plugin=__version__,
        sglang=releases.current_policy().version,
        page_size=getattr(kv_args, "page_size", None),
        kv_item_lens=list(getattr(kv_args, "kv_item_lens", None) or []),
        kv_head_num=getattr(kv_args, "kv_head_num", None),
        attn_tp_size=getattr(mgr, "attn_tp_size", None),
        kv_dtype=getattr(kv_args, "kv_cache_dtype_str", None),
        page_for_page=page_for_page,
    )


def note_peer_bounds(table: dict, unchecked: set, peer: str, msg, logger: logging.Logger, what: str,
                     unchecked_line: str) -> None:
    """Record in ``table[peer]`` the bounds registration ``msg`` carries; none (a stock
    decode) or a malformed frame: drop ``peer`` from ``table`` and, the first time, log
    ``unchecked_line`` (``%s`` = the peer). ``what`` names the peer in the error line."""
    try:
        bounds = bounds_in_message(msg)
    except IndexBoundsError as exc:
        logger.error("%s %s sent a malformed pool-sizes frame (%s); its requests are not checked", what, peer, exc)
        bounds = None
    if bounds is not None:
        table[peer] = bounds
        unchecked.discard(peer)
        return
    table.pop(peer, None)
    if peer not in unchecked:
        unchecked.add(peer)
        logger.info(unchecked_line, peer)


class FilteringSocket:
    """A manager's ZMQ socket whose received messages pass through ``on_message`` first.

    ``on_message(msg)`` returns the message stock's loop then reads: ``None`` for
    ``msg`` unchanged, a copy without a frame this plugin added, or
    :data:`CONSUMED` for a message of the plugin's own that stock never sees (the
    next message is read instead). Anything it raises is logged and the message
    handed on unchanged: the stock loop reading the socket (a bootstrap or decode
    thread) must never end on it. Every other attribute is the socket's own.
    """

    CONSUMED = object()

    def __init__(self, sock, on_message: Callable, logger: logging.Logger):
        self._sock = sock
        self._on_message = on_message
        self._logger = logger

    def recv_multipart(self, *args, **kwargs):
        while True:
            msg = self._sock.recv_multipart(*args, **kwargs)
            try:
                out = self._on_message(msg)
            except Exception:  # noqa: BLE001 - never end the thread reading this socket
                self._logger.exception("could not read the plugin's frames of a %d-frame message; handed on as sent",
                                       len(msg))
                return msg
            if out is not self.CONSUMED:
                return msg if out is None else out

    def __getattr__(self, name):
        return getattr(self._sock, name)


class FrameAppendingSocket:
    """A socket that appends ``frame`` to the messages ``selects(frames)`` picks, and
    sends every other message as given."""

    def __init__(self, sock, frame: bytes, selects: Callable):
        self._sock = sock
        self._frame = frame
        self._selects = selects

    def send_multipart(self, frames, *args, **kwargs):
        frames = list(frames)
        if self._selects(frames):
            frames.append(self._frame)
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def register_appending(receiver, frame: bytes, selects: Callable, register: Callable):
    """Run ``register()`` (stock ``_register_kv_args`` of ``receiver``) with ``frame``
    appended to the registration messages ``selects`` picks.

    Stock sends one message per prefill rank through the sockets
    ``receiver._connect_to_bootstrap_server`` hands out (a class-level cache); the
    wrapper shadows that method on this receiver for this call only (decode's
    scheduler thread, which is the only caller), so stock's frames go out
    unchanged and in order and nothing else sees the wrapped sockets.
    """
    connect = receiver._connect_to_bootstrap_server

    def connect_appending(bootstrap_info):
        sock, lock = connect(bootstrap_info)
        return FrameAppendingSocket(sock, frame, selects), lock

    receiver._connect_to_bootstrap_server = connect_appending
    try:
        return register()
    finally:
        del receiver._connect_to_bootstrap_server
