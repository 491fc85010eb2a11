"""nixl-ext on a pass-through release (a post-release of 0.5.13+ the table does not list): the name routes to SGLang's stock NIXL classes and moves bytes.

One 1P1D KV transfer (5 pages, prefill TP 1 -> decode TP 1) through the transfer harness: two processes,
SGLang's real bootstrap server and ``NixlKVManager``/sender/receiver, real NIXL over UCX (TCP on 127.0.0.1),
CPU pools; decode checks every destination byte and that every other page still holds the sentinel. Both
sides must end Success and both managers must be the stock class: on these releases ``-ext`` is only a name.

The one thing replaced, and why. SGLang 0.5.23 registers the KV pool as NIXL "VRAM" unless HiSparse puts it
in host memory (``disaggregation/decode.py:629``) and prepares its strided (Nx5) descriptor lists as "VRAM"
(``nixl/conn.py:862``, ``_prep_xfer_dlist``). On these CPU runners UCX has no CUDA support and refuses
("VRAM memory is detected as host by UCX ... VRAM registration cannot proceed", ``NIXL_ERR_BACKEND`` at
manager construction), which is an environment fact, not plugin behaviour. So both sides get the harness's
host-memory shim (``harness/nixl_shim.py``, the same one the stock F4 runs use: "VRAM" registrations and
descriptor lists are treated as "DRAM", device id 0, which is where these pools really are). That shim
covers ``register_memory``, ``get_xfer_descs`` and ``prep_xfer_dlist`` (0.5.23 passes its Nx5 lists straight
to the last; ``NIXL_ERR_NOT_FOUND`` without the rewrite there). Nothing else is replaced; the plugin is loaded as in production. On a GPU node the
shim is not needed (``docs/selftest-on-a-node.md``).

On releases the table lists this is n/a: ``nixl-ext`` is the plugin's own classes there (F4 up to 0.5.12.x,
``test_nixl_ext.py``; F13 on 0.5.13-0.5.21, ``test_nixl_swa_tp.py``; F11 on 0.5.22/0.5.23, ``test_nixl_newest.py``).
It runs on a post-release the table does not list (e.g. 0.5.19.post1), by hand.
"""

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim, run_scenario, scenario

POLICY = releases.current_policy()
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
RUN_TIMEOUT = 240  # one run: two workers' imports dominate on 2 shared cores

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        POLICY.routes("nixl"),
        reason=f"n/a on SGLang {POLICY.version} ({POLICY.support.value}): nixl-ext is the plugin's own classes "
        "there, not a pass-through name; differentials in test_nixl_ext.py (F4), test_nixl_swa_tp.py (F13), "
        "test_nixl_newest.py (F11)",
    ),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]

def _shim_env():
    return {nixl_shim.ENV: "1"}


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_nixl_ext_passes_through_to_stock_and_moves_bytes():
    res = run_scenario(scenario.kv_only("nixl-pass-through"), "nixl-ext", timeout_s=RUN_TIMEOUT,
                       extra_env=_shim_env())
    assert res.ok, res.describe()
    assert res.backend_effective == "nixl", res.describe()
    assert res.prefill_manager == STOCK_MANAGER and res.decode_manager == STOCK_MANAGER, res.describe()
    for role in ("prefill", "decode"):
        assert all(cls.startswith("sglang.srt.") for cls in res.classes[role].values()), res.classes
    (req,) = res.requests
    assert req.prefill_status == "Success" and req.decode_status == "Success", res.describe()
    assert req.bytes_verified and req.mismatches == [], res.describe()
    assert res.sglang_version == releases.installed_sglang_version()
    assert not res.killed, res.describe()
