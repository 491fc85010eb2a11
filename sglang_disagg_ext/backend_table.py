"""The one table of transfer backends: every other module reads its facts from here.

One :class:`Backend` record per engine. No SGLang import: the names are plain
strings, imported by whoever needs them (``registration``, ``doctor``, the CLI,
the self-test runner, the launcher's routing report, the deploy tools).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # SGLang's --disaggregation-transfer-backend value ("mooncake")
    ext_name: str  # the plugin's name for it ("mooncake-ext")
    sglang_package: str  # package whose names get_kv_class imports
    # Module each engine's SGLang backend imports first: importable <=> engine present (doctor).
    engine_module: str
    # Top-level packages of the engine: an ImportError naming one means "engine missing".
    engine_packages: Tuple[str, ...]
    adapter_module: str  # plugin module defining ext_classes(policy)
    # (module, function) that builds this backend's ``selftest`` rows.
    selftest_rows: Tuple[str, str]
    # SGLang's per-request classes in ``sglang_package``: one sender per request on prefill,
    # one receiver per request on decode (counted in ``transfers_total`` where -ext routes).
    sender_class: str = ""
    receiver_class: str = ""
    # SGLang's per-process KV manager class there (where engine-independent fixes are composed).
    manager_class: str = ""


BACKENDS: Tuple[Backend, ...] = (
    Backend(
        name="mooncake",
        ext_name="mooncake-ext",
        sglang_package="sglang.srt.disaggregation.mooncake",
        engine_module="mooncake.engine",
        engine_packages=("mooncake",),
        adapter_module="sglang_disagg_ext.backends.mooncake.conn",
        selftest_rows=("sglang_disagg_ext.selftest.runner", "mooncake_rows"),
        sender_class="MooncakeKVSender",
        receiver_class="MooncakeKVReceiver",
        manager_class="MooncakeKVManager",
    ),
    Backend(
        name="nixl",
        ext_name="nixl-ext",
        sglang_package="sglang.srt.disaggregation.nixl",
        engine_module="nixl._api",
        engine_packages=("nixl", "nixl_cu12"),
        adapter_module="sglang_disagg_ext.backends.nixl.conn",
        selftest_rows=("sglang_disagg_ext.selftest.scenarios.nixl_rows", "nixl_rows"),
        sender_class="NixlKVSender",
        receiver_class="NixlKVReceiver",
        manager_class="NixlKVManager",
    ),
    Backend(
        name="mori",
        ext_name="mori-ext",
        sglang_package="sglang.srt.disaggregation.mori",
        engine_module="mori.io",
        engine_packages=("mori",),
        adapter_module="sglang_disagg_ext.backends.mori.conn",
        selftest_rows=("sglang_disagg_ext.selftest.scenarios.mori_newest", "rows"),  # F3, then F12
        sender_class="MoriKVSender",
        receiver_class="MoriKVReceiver",
        manager_class="MoriKVManager",
    ),
)

BY_NAME: Dict[str, Backend] = {b.name: b for b in BACKENDS}
BY_EXT_NAME: Dict[str, Backend] = {b.ext_name: b for b in BACKENDS}

NAMES: Tuple[str, ...] = tuple(b.name for b in BACKENDS)
EXT_NAMES: Tuple[str, ...] = tuple(b.ext_name for b in BACKENDS)


def ext_to_base() -> Dict[str, str]:
    """``{"mooncake-ext": "mooncake", ...}`` in table order."""
    return {b.ext_name: b.name for b in BACKENDS}
