"""Real-engine transfer harness: prefill -> decode through SGLang's own classes.

``run_scenario(scenario, backend)`` starts one worker process per prefill and
decode rank (``harness.worker``, forked from a warm fork server: ``procs``), runs the scenario's requests through the real
bootstrap server, manager, sender and receiver of ``backend`` on CPU pools and
a real transfer engine over loopback TCP, and returns a ``ScenarioResult``
with each side's final KVPoll state and decode's byte-for-byte verification.
``protocol=``, ``device=``, ``ib_device=`` move the pools to a GPU and the
engines to RDMA (``harness.transport``).

Importing this package does not import SGLang or torch.
"""

from .run import RequestResult, ScenarioResult, find_free_port, format_table, run_scenario
from .scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    ScenarioError,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)

__all__ = [
    "KVPoolSpec",
    "RequestResult",
    "RequestSpec",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "StatePoolSpec",
    "StateSpec",
    "Timeouts",
    "find_free_port",
    "format_table",
    "run_scenario",
]
