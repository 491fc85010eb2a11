"""Random valid transfers for the verified-transfer tests (``test_mooncake_verify``,
``test_nixl_verify``): page maps, lengths (empty included), chunking, aux rows and the
given state kinds, every index inside its pool. Test-only; outside the wheel."""

import random
from typing import Sequence

from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, StatePoolSpec, StateSpec

KV_PAGES, STATE_PAGES = 24, 12


def random_scenario(rng: random.Random, n: int, page_size: int, kinds: Sequence[str], name: str,
                    kv_heads=(2, 16), state_heads=(1, 16), prefill_tp: int = 1, decode_tp: int = 1) -> Scenario:
    """``n`` requests; ``kv_heads`` / ``state_heads``: (heads, head dim) of the KV and state pools."""
    requests = []
    for _ in range(n):
        length = rng.randint(0, 6)
        state = []
        for kind in kinds:
            s_len = 1 if kind == "mamba" else rng.randint(0, 4)  # mamba: one slot to one slot
            state.append(StateSpec(kind, rng.sample(range(STATE_PAGES), s_len), rng.sample(range(STATE_PAGES), s_len)))
        requests.append(RequestSpec(
            rng.sample(range(KV_PAGES), length), rng.sample(range(KV_PAGES), length),
            aux_index=rng.randrange(8), dst_aux_index=rng.randrange(8), state=state, send_chunks=rng.randint(1, 3),
        ))
    return Scenario(
        name=name,
        requests=requests,
        page_size=page_size,
        kv=KVPoolSpec(num_pages=KV_PAGES, head_num=kv_heads[0], head_dim=kv_heads[1]),
        state_pools=[StatePoolSpec(kind=k, num_pages=STATE_PAGES, num_layers=2, head_num=state_heads[0],
                                   head_dim=state_heads[1]) for k in kinds],
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )
