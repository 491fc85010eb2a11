"""F7 pairing on its own (core.layer_pairing), the mixin's routing with a fake manager,
and the harness's decode-buffer mapping (patterns.source_buffer). Tables written by hand."""

import pytest

from sglang_disagg_ext.backends.mooncake.state_pairing import StatePairingMixin
from sglang_disagg_ext.core.layer_pairing import LayerPairingError, pair_state_layers
from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.scenarios.state_pairing import tail_layers

# (prefill buffers, decode buffers) -> decode K index of each prefill layer; decode
# buffers are K0..K(m-1), V0..V(m-1), so V of decode layer j is entry m + j.
TABLE = [
    (2, 2, (0,)),
    (4, 6, (0, 1)),  # one draft layer at decode's tail: it receives nothing
    (8, 10, (0, 1, 2, 3)),
    (8, 12, (0, 1, 2, 3)),
    (2, 6, (0,)),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n_src,n_dst,dst_of", TABLE)
def test_pairs_layer_l_with_layer_l(n_src, n_dst, dst_of):
    assert pair_state_layers("c", n_src, n_dst).dst_of == dst_of


@pytest.mark.timeout(10)
def test_split_puts_prefill_v_in_decode_v_of_the_same_layer():
    # prefill K0 K1 V0 V1; decode K0 K1 K2 V0 V1 V2 (K2/V2: draft)
    pairs = pair_state_layers("c", 4, 6)
    src_k, src_v, dst_k, dst_v = pairs.split(["pK0", "pK1", "pV0", "pV1"], ["K0", "K1", "K2", "V0", "V1", "V2"])
    assert (src_k, src_v, dst_k, dst_v) == (["pK0", "pK1"], ["pV0", "pV1"], ["K0", "K1"], ["V0", "V1"])
    assert pairs.decode_only == [2]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "n_src,n_dst,pp,needle",
    [
        (4, 6, 2, "state component 0 (swa): prefill has 2 layers (4 buffers), decode has 3 (6 buffers), prefill runs 2 pipeline stages"),
        (6, 4, 1, "state component 0 (swa): prefill has 3 layers (6 buffers), decode has 2 (4 buffers): decode lacks layers"),
        (3, 4, 1, "state component 0 (swa): prefill registered 3 buffers"),
        (4, 0, 1, "state component 0 (swa): decode registered 0 buffers"),
    ],
)
def test_refuses_what_cannot_be_paired(n_src, n_dst, pp, needle):
    with pytest.raises(LayerPairingError) as err:
        pair_state_layers("state component 0 (swa)", n_src, n_dst, pp_size=pp)
    assert needle in str(err.value)


@pytest.mark.timeout(10)
def test_equal_counts_pair_in_place_even_with_pp():
    assert pair_state_layers("c", 6, 6, pp_size=4).dst_of == (0, 1, 2)


# -- the mixin, over a fake manager (no SGLang) ---------------------------------------


class _FakeKVArgs:
    kv_data_ptrs = [100, 101, 102, 103]
    state_types = ["swa"]
    state_data_ptrs = [[200, 201, 202, 203]]
    state_item_lens = [[64, 64, 64, 64]]


class _FakeBase:
    pp_size = 1

    def __init__(self):
        self.kv_args = _FakeKVArgs()
        self.failed = []

    def get_mha_kv_ptrs_with_pp(self, src, dst):
        return ("stock", src, dst)

    def maybe_send_extra(self, req, indices, executor, info=None):
        # What the stock state path does: pair the component's buffers with decode's.
        self.get_mha_kv_ptrs_with_pp(self.kv_args.state_data_ptrs[0], info)
        return 0

    def _fail_state_send(self, req, reason):
        self.failed.append((req, reason))


class _Manager(StatePairingMixin, _FakeBase):
    pass


@pytest.mark.timeout(10)
def test_mixin_leaves_kv_to_stock_and_pairs_state():
    mgr = _Manager()
    assert mgr.get_mha_kv_ptrs_with_pp([100, 101, 102, 103], [1, 2, 3, 4, 5, 6]) == (
        "stock", [100, 101, 102, 103], [1, 2, 3, 4, 5, 6])
    # decode: K0 K1 K2 V0 V1 V2 at 10..15
    assert mgr.get_mha_kv_ptrs_with_pp([200, 201, 202, 203], [10, 11, 12, 13, 14, 15]) == (
        [200, 201], [202, 203], [10, 11], [13, 14], 2)
    # the head-slice path's second call, with the component's item lengths
    assert mgr.get_mha_kv_ptrs_with_pp([64, 64, 64, 64], [64, 64, 64, 65, 65, 65]) == (
        [64, 64], [64, 64], [64, 64], [65, 65], 2)


@pytest.mark.timeout(10)
def test_mixin_refusal_fails_the_request_not_the_thread():
    mgr = _Manager()
    mgr.pp_size = 2
    assert mgr.maybe_send_extra("req", [1], None, [10, 11, 12, 13, 14, 15]) == 0
    assert mgr.failed == [
        ("req", "state transfer refused: state component 0 (swa): prefill has 2 layers (4 buffers), decode has 3 "
                "(6 buffers), prefill runs 2 pipeline stages and no layer ids were published: which decode layers "
                "this stage holds is unknown, refusing rather than guessing")
    ]


# -- the harness's expectation -----------------------------------------------------------


@pytest.mark.timeout(10)
def test_source_buffer_maps_decode_layers_to_prefill_layers():
    scn = tail_layers("swa", 2, 1)  # prefill K0 K1 V0 V1; decode K0 K1 K2 V0 V1 V2
    pid = 2  # STATE_POOL_BASE + 0
    got = [patterns.source_buffer(scn, pid, b)[0] for b in range(6)]
    assert got == [0, 1, None, 2, 3, None]
    assert patterns.source_buffer(scn, pid, 0)[1] == [0, 1, 2, 3]
    assert patterns.source_buffer(scn, 0, 3) == (3, [])  # KV pool: unchanged
