"""Harness workers forked from the warm fork server (``selftest/harness/procs.py``).

Real runs through SGLang's stock Mooncake backend on 127.0.0.1: each scenario
still gets processes of its own (new PIDs, gone afterwards, nothing of their
process groups left), whether forked or started fresh, and the bytes check the
same either way.
"""

import os

import psutil
import pytest

from sglang_disagg_ext.selftest.harness import procs, run_scenario
from sglang_disagg_ext.selftest.harness import scenario as scenarios

pytestmark = pytest.mark.engine

RUN_TIMEOUT = 150


def _assert_gone(res):
    for name, pid in res.pids.items():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (name, pid)
        group = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pid]
        assert group == [], f"{name}: processes left in its group: {group}"


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.mark.timeout(RUN_TIMEOUT * 2 + 30)
def test_each_scenario_gets_its_own_forked_workers():
    first = run_scenario(scenarios.kv_only("procs one"), "mooncake", timeout_s=RUN_TIMEOUT)
    second = run_scenario(scenarios.kv_only("procs two"), "mooncake", timeout_s=RUN_TIMEOUT)
    for res in (first, second):
        assert res.ok, res.describe()
        assert res.launch == {"prefill": "forked", "decode": "forked"}, res.launch
        assert res.exit_codes == {"prefill": 0, "decode": 0}, res.describe()
        _assert_gone(res)
    assert set(first.pids.values()).isdisjoint(second.pids.values())


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_fresh_interpreters_when_the_fork_server_is_off(monkeypatch):
    monkeypatch.setenv(procs.FORKSERVER_ENV, "0")
    res = run_scenario(scenarios.kv_only("procs fresh"), "mooncake", timeout_s=RUN_TIMEOUT)
    assert res.ok, res.describe()
    assert res.launch == {"prefill": "fresh", "decode": "fresh"}, res.launch
    _assert_gone(res)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_servers_stop_by_pid():
    if not procs._SERVERS:
        assert run_scenario(scenarios.kv_only("procs start"), "mooncake", timeout_s=RUN_TIMEOUT).ok
    servers = list(procs._SERVERS.values())
    assert servers
    pids = [s.proc.pid for s in servers]
    procs.stop_servers()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
