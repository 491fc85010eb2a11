"""The soak through ``nixl-ext``, one rank a side: real NIXL over UCX (TCP) on loopback, CPU pools.

128 requests, 32 in flight, random page maps and sizes with an SWA state component and
an aux row each; one request in 16 carries a decode KV index outside the pool (handed to
SGLang's real ``send_metadata``). Every request is judged by the harness
(``selftest.soak.judge``): the faulted ones end Failed on both sides with a reason, every
other one Success with every byte right and no untargeted page written, nothing raised
into the caller, no thread gone. Replaced here: on releases where ``nixl-ext`` is stock
for memory registration (F4 not live), the rig's host-memory shim lets NIXL register the
CPU pools (``harness/nixl_shim.py``; UCX on this machine has no CUDA).

Not here, measured and reported instead (README, ``selftest --soak --backend nixl``): the
decode restart, because on 0.5.10.post1-0.5.12.x a NIXL prefill keeps the killed wave's
rooms whose metadata never came in Bootstrapping (no deadline, for stock and ``-ext``
alike), and stock's behaviour with out-of-pool indices, which differs by release (raises
into the caller on 0.5.11, Failed on 0.5.23). Dropped writes are Mooncake-only
(``harness/faults.py``).
"""

import pytest

from sglang_disagg_ext.selftest import soak

pytestmark = pytest.mark.engine


@pytest.mark.timeout(180)
def test_nixl_ext_soak_fails_exactly_the_bad_requests():
    cfg = soak.SoakConfig(requests=128, wave=32, fault_rate=0.0, bad_rate=1 / 16, seed=11, restart_decode=False)
    s = soak.run_soak("nixl-ext", cfg)
    assert s["passed"], soak.format_summaries([s])
    assert s["faults_injected"]["bad_index"] > 0
    assert s["outcomes"]["failed_as_faulted"] == s["faults_injected"]["bad_index"]
    assert s["outcomes"]["ok"] == cfg.requests - s["outcomes"]["failed_as_faulted"]
    assert s["outcomes"]["raised"] == 0 and s["outcomes"]["hung"] == 0


def test_nixl_soak_refuses_dropped_writes():
    with pytest.raises(ValueError, match="Mooncake's engine only"):
        soak.run_soak("nixl", soak.SoakConfig(requests=8, wave=4, fault_rate=0.5))
