"""Test-only: a NIXL peer process that registers a host buffer and answers checksum requests.

It stands where a decode's NIXL agent stands for a prefill's transfer: a separate process with its own
agent and UCX context, whose memory a prefill-side agent writes with real UCX transfers. The test
stops it (SIGSTOP: a stalled decode), continues it and kills it, by its PID.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Tuple

BUFFER_BYTES = 256 << 20  # far larger than TCP socket buffers and UCX send queues: a write to a stopped peer cannot complete


def _serve(ucx_tls: str, to_parent, from_parent) -> None:
    os.environ["UCX_TLS"] = ucx_tls
    import torch

    from sglang_disagg_ext.selftest.harness.nixl_pacing import pace_progress_thread
    from nixl._api import nixl_agent, nixl_agent_config

    pace_progress_thread(100)  # a paced progress thread: two cores, two agents
    agent = nixl_agent("nixl-peer", nixl_agent_config(backends=["UCX"]))
    buf = torch.zeros(BUFFER_BYTES, dtype=torch.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM"))
    to_parent.put((agent.get_agent_metadata(), buf.data_ptr(), buf.numel()))
    while True:
        command = from_parent.get()
        if command == "sum":
            to_parent.put(int(buf.sum(dtype=torch.int64)))
        elif command == "zero":
            buf.zero_()
            to_parent.put(0)
        else:
            return


class NixlPeer:
    def __init__(self, ucx_tls: str = "tcp,self"):
        ctx = mp.get_context("spawn")
        self._to_parent, self._from_parent = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(ucx_tls, self._to_parent, self._from_parent), daemon=True)
        self.proc.start()
        self.metadata, self.ptr, self.nbytes = self._to_parent.get(timeout=120)

    def ask(self, command: str, timeout: float = 30.0):
        self._from_parent.put(command)
        return self._to_parent.get(timeout=timeout)

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)

    def region(self) -> Tuple[int, int]:
        return self.ptr, self.nbytes
