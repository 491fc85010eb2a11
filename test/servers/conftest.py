"""The real-server stage: SGLang's own server processes on this CPU machine (``make e2e``).

One colocated server per session (the reference), and PD pairs started through
``launch-pd --device cpu`` with SGLang's router when a test first needs them: ``nixl-ext`` over
UCX (its own module, first, stopped after it: NIXL's idle schedulers poll a core each), then
``mooncake-ext`` and stock ``mooncake`` over Mooncake TCP, started together, each with a fault
folder its prefill reads (``test/support/cpu_server/server_faults.py``). Every server and
router is stopped by its PID; their logs stay in the session's temporary folder (pytest keeps
the last three) and failing tests print their tails.
"""

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import cpu_servers as cs  # noqa: E402

from sglang_disagg_ext import releases  # noqa: E402

# Modules in this order: token equality before the faults disturb the servers.
ORDER = ("test_pd_nixl.py", "test_pd_tokens.py", "test_gsm8k_pipeline.py", "test_pd_rooms.py", "test_pd_faults.py")


def pytest_collection_modifyitems(config, items):
    # Server tests share servers and the machine's two cores: never in parallel.
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("test/servers runs in one process (-n 0): its tests share one set of servers")
    rank = {name: i for i, name in enumerate(ORDER)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(ORDER)))


@pytest.fixture(scope="session")
def policy():
    return releases.current_policy()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    import subprocess

    folder = tmp_path_factory.mktemp("model") / "tiny"
    done = subprocess.run(cs.CLI + ["tiny-model", str(folder), "--with-weights"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(folder)


class Deployment:
    FAULTED = ("mooncake-ext", "mooncake")

    def __init__(self, root: Path, model: str):
        from sglang_disagg_ext.deploy.commands import build_colocated_server
        from sglang_disagg_ext.deploy.procs import Launcher, free_ports

        self.root, self.model = root, model
        self.fault_dirs = {}
        self.pairs = {}
        (port,) = free_ports("127.0.0.1", 1)
        self.colocated_spec = build_colocated_server(model, port, sys.executable, device="cpu",
                                                     extra_args=cs.server_flags())
        env = cs.server_env()
        self.colocated_spec.env.update({k: env[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS")})
        self.launcher = Launcher(root / "colocated")
        self._reference = {}
        self._colocated_ready = False

    def ensure(self, backends):
        """Start the colocated server (once) and every pair of ``backends`` not running, together."""
        new = []
        for backend in backends:
            if backend not in self.pairs:
                fault_dir = None
                if backend in self.FAULTED:
                    fault_dir = self.root / f"faults-{backend}"
                    fault_dir.mkdir(exist_ok=True)
                    self.fault_dirs[backend] = fault_dir
                self.pairs[backend] = cs.PDPair(self.root / f"pd-{backend}", backend, self.model, fault_dir)
                new.append(self.pairs[backend])
        if not self._colocated_ready:
            self.launcher.start(self.colocated_spec)
        errors = []

        def start():
            try:
                cs.start_pairs(new)
            except AssertionError as exc:
                errors.append(exc)

        thread = threading.Thread(target=start)
        thread.start()
        if not self._colocated_ready:
            self.launcher.wait_healthy(["colocated"], timeout=600)
            self._colocated_ready = True
        thread.join()
        if errors:
            raise errors[0]

    def stop_pair(self, backend):
        pair = self.pairs.pop(backend, None)
        if pair is not None:
            pair.stop()

    @property
    def colocated_url(self) -> str:
        return self.colocated_spec.url

    def reference(self, prompt: str):
        """The colocated server's greedy output ids for ``prompt`` (asked once)."""
        if prompt not in self._reference:
            self._reference[prompt] = cs.output_ids(self.colocated_url, prompt)
        return self._reference[prompt]

    def stop(self):
        problems = []
        for backend in list(self.pairs):
            try:
                self.stop_pair(backend)
            except AssertionError as exc:
                problems.append(str(exc))
        self.launcher.stop_all(grace=10)
        left = cs._pids_alive([p.pid for p in self.launcher.procs.values()])
        assert not left and not problems, f"servers left running: {left} {problems}"


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, tiny_model):
    dep = Deployment(tmp_path_factory.mktemp("servers"), tiny_model)
    try:
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="session")
def mooncake_pairs(deployment):
    """The ``mooncake-ext`` and stock ``mooncake`` pairs (started on first use, kept for the session)."""
    deployment.ensure(Deployment.FAULTED)
    return deployment
