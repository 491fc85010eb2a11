"""Test-only: what stock SGLang's servers need to serve PD on a CPU machine, and the e2e faults.

Loaded by Python itself (``site`` imports ``sitecustomize``) in every process whose
``PYTHONPATH`` starts with this folder: the real-server tests start the servers that way
(``test/support/cpu_servers.py``), and SGLang's scheduler processes inherit it. Nothing here
is in the wheel, and nothing here runs in a process the tests did not start.

Each replacement is one attribute, applied when the stock module defining it is first
imported, and names the stock line it stands in for:

* ``MooncakeKVSender.supports_host_tensor_indices = False``: 0.5.23
  ``disaggregation/mooncake/conn.py:3312`` sets it True, and then prefill's
  ``send_kv_chunk`` (``disaggregation/prefill.py:1746-1761``) copies the page index to a
  ``pin_memory=True`` host tensor and records a ``torch.cuda.Event``: "pin_memory=True
  requires a CUDA or other accelerator backend" on the first request of a CPU server. False
  takes the release's own other branch (``kv_to_page_indices``, the path of every other
  engine and of 0.5.11). The pages and indices sent are the same.
* NIXL's agent treats memory registered or addressed as ``"VRAM"`` as ``"DRAM"`` (the self-test
  rig's ``nixl_shim``, three methods of ``nixl_agent``), applied when ``nixl`` is imported:
  SGLang labels its pools ``"VRAM"`` whatever the device (0.5.23 ``disaggregation/decode.py:629-633``
  and ``nixl/conn.py:979``; 0.5.11 ``nixl/conn.py:339``, ``:362``, ``:470-471``), and a UCX built
  without CUDA refuses such a registration ("VRAM memory is detected as host"). On a CPU server
  every pool is host memory, so ``"DRAM"`` is where the bytes really are. Memory the plugin
  registers as ``"DRAM"`` itself (its F4 classes, 0.5.10.post1-0.5.12.x) is left as it is.

The other walls need no code: ``SGLANG_USE_CPU_ENGINE=1`` (``is_cpu()``, 0.5.23
``srt/utils/common.py:221-224``), ``--disaggregation-decode-retraction-backup cpu_tensor``
(0.5.23 decode's default host-pool backup calls ``torch.cuda.cudart()``) and
``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0`` (the cached-prefix early send records a
``torch.cuda.Event``, 0.5.23 ``prefill.py:1494-1496``) are SGLang's own switches, set by the
launcher's ``--device cpu``. ``sgl_kernel`` (imported, never called, on these paths) comes from
``scripts/cpu_stubs`` on the same ``PYTHONPATH``.

Faults (``server_faults``) are armed only where ``SGLANG_E2E_FAULT_DIR`` is set.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _mooncake_sender_host_indices(module) -> None:
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is not None and "supports_host_tensor_indices" in vars(sender):
        sender.supports_host_tensor_indices = False


def _nixl_host_memory(module) -> None:
    from sglang_disagg_ext.selftest.harness import nixl_shim

    nixl_shim.install()


def _arm_faults(module) -> None:
    import server_faults

    server_faults.install(module)


_AFTER_IMPORT = {
    "sglang.srt.disaggregation.mooncake.conn": [_mooncake_sender_host_indices],
    "nixl": [_nixl_host_memory],
}
if os.environ.get("SGLANG_E2E_FAULT_DIR"):
    _AFTER_IMPORT["sglang.srt.disaggregation.mooncake.conn"].append(_arm_faults)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the functions of ``_AFTER_IMPORT`` once their module has executed."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        stock_exec = spec.loader.exec_module

        def exec_module(module):
            stock_exec(module)
            for patch in _AFTER_IMPORT[name]:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
