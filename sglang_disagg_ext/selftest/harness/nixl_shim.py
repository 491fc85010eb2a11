"""Self-test rig only (never the plugin): let *stock* NIXL code register and address host memory.

Stock 0.5.10.post1 - 0.5.12.x register KV and state buffers as "VRAM" and
build every KV/state descriptor list as "VRAM". On a machine whose UCX has no
CUDA support (these CPU runners) that fails at manager construction, so a
stock run would never reach the code a differential test is about (head slice,
notification keys). A worker child started with
``SGLANG_HARNESS_NIXL_HOST_MEMORY=1`` calls :func:`install` before any manager
exists: from then on the NIXL agent class treats "VRAM" as "DRAM" (device id
0), which is where the harness pools really are. Only the harness sets the
variable, only for the stock side of a scenario whose point is not memory
kinds; ``-ext`` runs never get it (the plugin registers host memory itself).
The SWA-from-host-memory scenario runs stock without it and shows the failure.
It ships with the self-test because the operator's ``selftest`` runs the same
stock rows on CPU pools; 0.5.23 also hands its strided (N x 5) lists straight
to ``prep_xfer_dlist``, so that call is rewritten the same way.
"""

from __future__ import annotations

import os

ENV = "SGLANG_HARNESS_NIXL_HOST_MEMORY"


def wanted() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def install() -> str:
    """Patch ``nixl_agent`` in this process; returns a line for the worker's result."""
    import numpy as np
    from nixl._api import nixl_agent

    if getattr(nixl_agent, "_harness_host_memory", False):
        return "nixl host-memory shim (already installed)"
    register_memory = nixl_agent.register_memory
    get_xfer_descs = nixl_agent.get_xfer_descs

    prep_xfer_dlist = nixl_agent.prep_xfer_dlist

    def _host(descs):
        # (addr, len, dev) rows, or 0.5.23's strided (addr, len, dev, stride, count) rows.
        if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] in (3, 5):
            descs = descs.copy()
            descs[:, 2] = 0
            return descs
        if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
            return [(d[0], d[1], 0) + tuple(d[3:]) for d in descs]
        return descs

    def register_memory_host(self, reg_list, mem_type=None, *args, **kwargs):
        if mem_type == "VRAM":
            reg_list, mem_type = _host(reg_list), "DRAM"
        return register_memory(self, reg_list, mem_type, *args, **kwargs)

    def get_xfer_descs_host(self, descs, mem_type=None, *args, **kwargs):
        if mem_type == "VRAM":
            descs, mem_type = _host(descs), "DRAM"
        return get_xfer_descs(self, descs, mem_type, *args, **kwargs)

    def prep_xfer_dlist_host(self, agent_name, xfer_list, mem_type=None, *args, **kwargs):
        if mem_type == "VRAM":
            xfer_list, mem_type = _host(xfer_list), "DRAM"
        return prep_xfer_dlist(self, agent_name, xfer_list, mem_type, *args, **kwargs)

    nixl_agent.register_memory = register_memory_host
    nixl_agent.get_xfer_descs = get_xfer_descs_host
    nixl_agent.prep_xfer_dlist = prep_xfer_dlist_host
    nixl_agent._harness_host_memory = True
    return "nixl host-memory shim: VRAM registrations and descriptors treated as DRAM (stock run, test only)"
