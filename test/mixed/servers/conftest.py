"""Real servers of two releases side by side (``make mixed``): one pytest process, no xdist."""

import pytest


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("test/mixed/servers runs in one process (-n 0): its tests share one set of servers")
