"""Prometheus metrics of the plugin, on SGLang's own ``/metrics``.

SGLang (``--enable-metrics``) points ``PROMETHEUS_MULTIPROC_DIR`` at one
directory before it starts its scheduler processes, and its HTTP server serves
``/metrics`` from a ``MultiProcessCollector`` over that directory. Metrics made
here with ``prometheus_client``'s default registry in a scheduler process (where
the managers and so the transfers live) are therefore written to that
directory and served next to SGLang's own, with no server of their own.

``prometheus_client`` picks its value store (in-process or the multiprocess
directory) when it is first imported, so nothing here imports it before the
first metric is touched: by then SGLang has set the directory. Without
``prometheus_client`` every call is a no-op. A metric update never raises into
the transfer path.

Every series also carries SGLang's own scheduler labels where the process's manager holds
them (``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``dp_rank``, then
``--extra-metric-labels``; ``releases.sglang_metric_labels``), so a rule can join or divide
the plugin's series by SGLang's. They are fixed when the first ``-ext`` manager of the process
is built (``activation_log.announce``), before any series exists; an extra label named like one
of the plugin's own (``backend``, ``role``, ...) is left out, with a warning.

Names (all prefixed ``sglang_disagg_ext_``):

* ``info`` (gauge, 1): labels ``version``, ``commit`` (the build's, ``build_info.commit``: two
  builds of one version told apart), ``backend`` (the ``-ext`` name),
  ``sglang``, ``fixes`` (the fixes the plugin installs here).
* ``state_trims_total``: F1 page-list trims, by ``component`` and ``kind``.
* ``requests_refused_total``: requests ended before the engine, by ``fix`` and
  ``reason`` (a short category, never request data).
* ``transfer_failures_total``: requests the plugin ended Failed after their
  transfer started, by ``fix`` and ``reason`` (F10: metadata never landed).
* ``thread_recoveries_total``: transfer-path loops re-entered after an
  exception (F8 on Mooncake; F11: NIXL's bootstrap thread after a failed
  registration, its decode listener after a failed status message), by ``role`` and ``thread``.
* ``bootstrap_messages_dropped_total``: F15, messages NIXL prefill's bootstrap
  thread would have died of (foreign, short, malformed, unparsable), dropped before
  stock's loop, by ``backend`` and ``reason``.
* ``session_probes_total``: F6 probes of a Mooncake decode session after a failed
  transfer, by ``fix`` and ``result`` (``alive``: the session stays usable;
  ``dead``: marked failed, as stock marks it).
* ``kv_holds_total``: F21, on decode, by ``event``: ``held`` (a failed request's pages kept past
  SGLang's deferred release timeout, prefill not having confirmed its writes stopped), then how
  they went back: ``drained`` (prefill confirmed), ``peer_gone`` (every prefill rank endpoint refuses
  connections: its process is gone) or ``limit`` (``SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S``, without proof).
  ``held`` minus the other two is the rooms held now.
* ``retract_offloads_total``: F5 index-key offloads on retract.
* ``verified_transfers_total``: rooms decode checked with ``SGLANG_DISAGG_EXT_VERIFY=1``,
  by ``result`` (``ok``; ``unverified``: some source rank sent no digest, the room succeeded;
  ``refused_unverified``: the same under ``SGLANG_DISAGG_EXT_VERIFY=require``, the room failed).
* ``verify_mismatches_total``: verified rooms ended Failed, by ``component``
  (``kv``, ``aux``, ``stateN``; ``frame``: a digest frame that could not be checked).
* ``verify_mismatch_reports_total``: on prefill, rooms it had concluded Success that a
  decode then failed on a digest mismatch and reported back.
* ``verify_mismatch_notices_sent_total``: on decode, those reports sent, by ``prefill``
  (the prefill rank's bootstrap address ``host:port``: which prefill sent bytes that did not land).
* ``transfers_total``: requests whose transfer reached a definite state, by ``backend`` (the
  ``-ext`` name), ``role`` (``prefill``: sent; ``decode``: received) and ``outcome``
  (``success``, ``failed``): the denominator of a failure ratio. Both outcomes exist at zero
  from the manager's start.
* ``transfer_duration_seconds`` (histogram): for those requests, seconds from SGLang creating
  the request's sender (prefill) or receiver (decode) to the definite state, by ``backend`` and
  ``role``: bootstrap, queueing behind the prefill forward, and the transfer itself.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Optional, Tuple

logger = logging.getLogger("sglang_disagg_ext.metrics")

PREFIX = "sglang_disagg_ext_"

# name -> (kind, help, label names)
DEFINITIONS: Dict[str, Tuple[str, str, Tuple[str, ...]]] = {
    "info": ("gauge", "sglang-disagg-ext is active in this process (value 1)",
             ("version", "commit", "backend", "sglang", "fixes")),
    "state_trims_total": ("counter", "State page lists aligned by trimming the longer side (F1)", ("component", "kind")),
    "requests_refused_total": ("counter", "Requests ended Failed before reaching the transfer engine", ("fix", "reason")),
    "transfer_failures_total": (
        "counter", "Requests the plugin ended Failed after the transfer started", ("fix", "reason")),
    "thread_recoveries_total": (
        "counter", "Transfer-path loops re-entered after an unexpected exception (F8, F11)", ("role", "thread")),
    "bootstrap_messages_dropped_total": (
        "counter", "Messages on prefill's bootstrap socket that stock's loop would have died of, dropped (F15)",
        ("backend", "reason")),
    "session_probes_total": (
        "counter", "Decode sessions probed after a failed transfer before being marked failed (F6)", ("fix", "result")),
    "kv_holds_total": (
        "counter", "Failed requests whose pages decode kept past SGLang's deferred release timeout (held), "
        "and how they went back (drained, peer_gone, limit) (F21)", ("event",)),
    "retract_offloads_total": ("counter", "NSA index-key offloads on retract (F5)", ()),
    "verified_transfers_total": (
        "counter", "Rooms decode checked against the prefill digest (SGLANG_DISAGG_EXT_VERIFY=1)", ("result",)),
    "verify_mismatches_total": (
        "counter", "Verified rooms ended Failed on a digest mismatch (SGLANG_DISAGG_EXT_VERIFY=1)", ("component",)),
    "verify_mismatch_reports_total": (
        "counter", "Rooms this prefill sent that a decode reported as failing verification (SGLANG_DISAGG_EXT_VERIFY=1)", ()),
    "verify_mismatch_notices_sent_total": (
        "counter", "Mismatch notices this decode sent, by prefill rank address (SGLANG_DISAGG_EXT_VERIFY=1)", ("prefill",)),
    "transfers_total": (
        "counter", "Requests whose KV transfer reached a definite state (success or failed)",
        ("backend", "role", "outcome")),
    "transfer_duration_seconds": (
        "histogram", "Seconds from a request's sender or receiver creation to its definite transfer state",
        ("backend", "role")),
}

# SGLang's scheduler label names a series can carry besides its own (releases.sglang_metric_labels;
# ``--extra-metric-labels`` adds the operator's).
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank")

# Every label name the plugin's own series use: an extra SGLang label of one of these names is not added.
OWN_LABELS = frozenset(label for _, _, labels in DEFINITIONS.values() for label in labels)

# transfer_duration_seconds: from a few ms (a small request on a quiet node) to SGLang's
# 300 s default timeouts.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OUTCOMES = ("success", "failed")

_mu = threading.Lock()
_metrics: Dict[str, object] = {}
_unavailable = False
# SGLang's labels for every series of this process (set_process_labels); frozen with the first series.
_process_labels: Dict[str, str] = {}


def set_process_labels(labels: Dict[str, str]) -> bool:
    """Give every series of this process ``labels`` (SGLang's, see the module docstring).
    True if taken; False once a series exists (a series' label names cannot change)."""
    global _process_labels
    with _mu:
        if _metrics:
            if labels != _process_labels:
                logger.debug("process labels %s not taken: series already exist", labels)
            return False
        taken = {str(k): str(v) for k, v in labels.items() if str(k) not in OWN_LABELS}
        if len(taken) < len(labels):
            logger.warning("sglang-disagg-ext metrics: label(s) %s not added to the plugin's series: the plugin "
                           "uses those names itself", sorted(set(map(str, labels)) & OWN_LABELS))
        _process_labels = taken
        return True


def _labels_of(name: str) -> Tuple[str, ...]:
    """``name``'s label names: its own, then the process labels."""
    return DEFINITIONS[name][2] + tuple(_process_labels)


def _series(metric, name: str, labels: Dict[str, object]):
    """The child of ``metric`` for ``labels`` plus the process labels (``metric`` itself where it has none)."""
    if not labels and not _process_labels:
        return metric
    return metric.labels(**{k: str(v) for k, v in labels.items()}, **_process_labels)


def _metric(name: str):
    global _unavailable
    with _mu:
        if name in _metrics or _unavailable:
            return _metrics.get(name)
        try:
            import prometheus_client
        except ImportError:
            _unavailable = True
            return None
        kind, doc, _ = DEFINITIONS[name]
        labels = _labels_of(name)
        # The prefix-less "_total" suffix is prometheus_client's for counters.
        base = PREFIX + (name[: -len("_total")] if kind == "counter" else name)
        if kind == "counter":
            metric = prometheus_client.Counter(base, doc, labels)
        elif kind == "histogram":
            metric = prometheus_client.Histogram(base, doc, labels, buckets=DURATION_BUCKETS)
        else:
            # Multiprocess mode: every live scheduler process says 1.
            metric = prometheus_client.Gauge(base, doc, labels, multiprocess_mode="liveall")
        _metrics[name] = metric
        return metric


def count(name: str, amount: float = 1.0, **labels: str) -> None:
    """Add ``amount`` to counter ``name`` (see the module docstring); never raises."""
    try:
        metric = _metric(name)
        if metric is None:
            return
        _series(metric, name, labels).inc(amount)
    except Exception:  # noqa: BLE001 - a metric must never fail a transfer
        logger.debug("metric %s not updated", name, exc_info=True)


def transfer_done(backend: str, role: str, outcome: str, seconds: float) -> None:
    """One request's transfer reached ``outcome`` after ``seconds``; never raises."""
    count("transfers_total", backend=backend, role=role, outcome=outcome)
    try:
        metric = _metric("transfer_duration_seconds")
        if metric is not None:
            _series(metric, "transfer_duration_seconds", {"backend": backend, "role": role}).observe(seconds)
    except Exception:  # noqa: BLE001
        logger.debug("transfer_duration_seconds not updated", exc_info=True)


def zero_transfer_series(backend: str, role: str) -> None:
    """Create this process's transfer series at zero, so a rate() has a baseline from the start."""
    try:
        counter = _metric("transfers_total")
        if counter is not None:
            for outcome in OUTCOMES:
                _series(counter, "transfers_total", {"backend": backend, "role": role, "outcome": outcome})
        histogram = _metric("transfer_duration_seconds")
        if histogram is not None:
            _series(histogram, "transfer_duration_seconds", {"backend": backend, "role": role})
    except Exception:  # noqa: BLE001
        logger.debug("transfer series not created", exc_info=True)


def set_info(version: str, backend: Optional[str], sglang: Optional[str], fixes) -> None:
    """The ``info`` gauge for this process (called once the ``-ext`` manager exists)."""
    try:
        from sglang_disagg_ext import build_info

        metric = _metric("info")
        if metric is not None:
            _series(metric, "info", {"version": version, "commit": build_info.commit(), "backend": backend or "",
                                     "sglang": sglang or "", "fixes": ",".join(fixes)}).set(1)
    except Exception:  # noqa: BLE001
        logger.debug("info metric not set", exc_info=True)
