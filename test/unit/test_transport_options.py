"""``harness.transport``: the selftest's --protocol/--device/--ib-device, pure logic.

Expected values are written out by hand from the rules in the module
docstring (Mooncake's TCP fallback, UCX transport lists), not computed by the
code under test.
"""

import numpy as np
import pytest

from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.harness.transport import (
    TransferOptions,
    TransportOptionError,
    engine_env,
    mooncake_hcas,
    mooncake_transport,
    parse_device,
    rdma_init_failure,
    ucx_net_devices,
    ucx_tls,
)
from sglang_disagg_ext.selftest.runner import NON_CUDA_MOONCAKE, cuda_problem

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "text, expected",
    [("cpu", ("cpu", None)), ("cuda", ("cuda", 0)), ("cuda:0", ("cuda", 0)), ("cuda:3", ("cuda", 3)),
     (" cuda:1 ", ("cuda", 1))],
)
def test_parse_device(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cpu:0", "cuda:", "cuda:-1", "cuda:x", "", "CUDA"])
def test_parse_device_rejects_with_the_value_named(text):
    with pytest.raises(TransportOptionError, match="expected cpu, cuda or cuda:N") as exc:
        parse_device(text)
    assert repr(text) in str(exc.value)


def test_validated_normalises():
    assert TransferOptions("TCP", "cuda", None).validated() == TransferOptions("tcp", "cuda:0", None)
    assert TransferOptions("rdma", "cpu", " mlx5_0 ").validated() == TransferOptions("rdma", "cpu", "mlx5_0")
    assert TransferOptions("rdma", "cpu", "").validated().ib_device is None


def test_validated_rejects_unknown_protocol():
    with pytest.raises(TransportOptionError, match=r"--protocol 'efa': expected one of tcp, rdma"):
        TransferOptions("efa").validated()


def test_ib_device_needs_rdma():
    with pytest.raises(TransportOptionError, match=r"--ib-device 'mlx5_0' .* only with --protocol rdma"):
        TransferOptions("tcp", "cpu", "mlx5_0").validated()


def test_worker_args_and_properties():
    opts = TransferOptions("rdma", "cuda:2", "mlx5_1").validated()
    assert opts.worker_args() == ["--protocol", "rdma", "--device", "cuda:2", "--ib-device", "mlx5_1"]
    assert (opts.device_type, opts.gpu_index, opts.is_default) == ("cuda", 2, False)
    default = TransferOptions()
    assert default.worker_args() == ["--protocol", "tcp", "--device", "cpu"]
    assert (default.device_type, default.gpu_index, default.is_default) == ("cpu", 0, True)


def test_engine_env_default_is_tcp_on_cpu():
    set_vars, unset = engine_env(TransferOptions())
    assert set_vars == {
        "MOONCAKE_PROTOCOL": "tcp",
        "MC_FORCE_TCP": "1",
        "SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX",
        "UCX_TLS": "tcp,self,sm",
        "CUDA_VISIBLE_DEVICES": "",
    }
    assert unset == ("UCX_NET_DEVICES",)


def test_engine_env_rdma_removes_force_tcp_and_names_devices():
    set_vars, unset = engine_env(TransferOptions("rdma", "cuda:1", "mlx5_0,mlx5_2:2"))
    assert set_vars == {
        "MOONCAKE_PROTOCOL": "rdma",
        "SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX",
        "UCX_TLS": "rc,ud,self,cuda_copy",
        "UCX_NET_DEVICES": "mlx5_0:1,mlx5_2:2",
    }
    # GPU pools: the child keeps the GPUs the parent sees.
    assert "CUDA_VISIBLE_DEVICES" not in set_vars
    assert unset == ("MC_FORCE_TCP",)


def test_engine_env_rdma_without_device_leaves_ucx_to_choose():
    set_vars, unset = engine_env(TransferOptions("rdma"))
    assert "UCX_NET_DEVICES" not in set_vars
    assert unset == ("MC_FORCE_TCP", "UCX_NET_DEVICES")


@pytest.mark.parametrize(
    "protocol, device_type, expected",
    [("tcp", "cpu", "tcp,self,sm"), ("tcp", "cuda", "tcp,self,sm,cuda_copy"),
     ("rdma", "cpu", "rc,ud,self"), ("rdma", "cuda", "rc,ud,self,cuda_copy")],
)
def test_ucx_tls(protocol, device_type, expected):
    assert ucx_tls(protocol, device_type) == expected


def test_ucx_net_devices():
    assert ucx_net_devices("mlx5_0") == "mlx5_0:1"
    assert ucx_net_devices(" mlx5_0 , mlx5_1:2 ,") == "mlx5_0:1,mlx5_1:2"


# Answers of TransferEngine.get_local_topology() seen on this machine
# (mooncake-transfer-engine-non-cuda 0.3.13.post1, no RDMA device): protocol
# rdma or tcp without MC_FORCE_TCP, and with MC_FORCE_TCP=1.
TOPOLOGY_NO_HCA = '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'
TOPOLOGY_FORCE_TCP = "{}\n"
# A two-socket RDMA node, written by hand in the same shape.
TOPOLOGY_TWO_HCAS = '{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cpu:1": [["mlx5_1"], ["mlx5_0"]], "cuda:0": [["mlx5_0"], []]}'


def test_mooncake_hcas():
    assert mooncake_hcas(TOPOLOGY_NO_HCA) == []
    assert mooncake_hcas(TOPOLOGY_FORCE_TCP) == []
    assert mooncake_hcas("") == []
    assert mooncake_hcas(TOPOLOGY_TWO_HCAS) == ["mlx5_0", "mlx5_1"]


def test_mooncake_hcas_rejects_garbage():
    with pytest.raises(ValueError, match="not JSON"):
        mooncake_hcas("cpu:0 mlx5_0")
    with pytest.raises(ValueError, match="not a JSON object"):
        mooncake_hcas("[1, 2]")


@pytest.mark.parametrize(
    "protocol_arg, force_tcp, hcas, expected",
    [
        ("rdma", True, None, "tcp"),  # 0.5.10-0.5.12 with MC_FORCE_TCP: the harness default
        ("tcp", True, None, "tcp"),  # 0.5.13+ with MOONCAKE_PROTOCOL=tcp
        ("tcp", False, None, "tcp"),
        ("rdma", False, [], "tcp"),  # Mooncake's silent fallback measured here
        ("rdma", False, ["mlx5_0"], "rdma"),
        ("efa", False, [], "efa"),
        (None, False, None, None),
    ],
)
def test_mooncake_transport(protocol_arg, force_tcp, hcas, expected):
    assert mooncake_transport(protocol_arg, force_tcp, hcas) == expected


def test_rdma_init_failure_wording():
    assert rdma_init_failure("Mooncake TransferEngine", "mlx5_0", "no HCA") == (
        "RDMA init failed: Mooncake TransferEngine: no HCA (ib device tried: mlx5_0)"
    )
    assert rdma_init_failure("NIXL UCX backend", None, "x").endswith("(ib device tried: none given (auto-discovery))")


def _cuda_facts(**kw):
    facts = dict(cuda_available=True, device_count=2, torch_version="2.13.0", torch_cuda="12.8",
                 mooncake_builds=["mooncake-transfer-engine"])
    facts.update(kw)
    return facts


def test_cuda_problem():
    assert cuda_problem("cuda", **_cuda_facts()) is None
    assert cuda_problem("cuda:1", **_cuda_facts()) is None
    no_cuda = cuda_problem("cuda", **_cuda_facts(cuda_available=False, device_count=0, torch_cuda=None))
    assert no_cuda.startswith("--device cuda: CUDA is not available here (torch.cuda.is_available() is False")
    assert "built for CUDA None" in no_cuda
    assert cuda_problem("cuda:2", **_cuda_facts()) == (
        "--device cuda:2: GPU index 2 does not exist here (2 GPU(s) visible)"
    )
    assert NON_CUDA_MOONCAKE in cuda_problem("cuda", **_cuda_facts(mooncake_builds=[NON_CUDA_MOONCAKE]))
    # Both builds installed, or a NIXL-only run (no Mooncake asked about): no objection.
    assert cuda_problem("cuda", **_cuda_facts(mooncake_builds=["mooncake-transfer-engine", NON_CUDA_MOONCAKE])) is None
    assert cuda_problem("cuda", **_cuda_facts(mooncake_builds=[])) is None


def test_compare_buffer_takes_a_tensor():
    """Decode verification copies a tensor to host before comparing (device pools need it).

    Only a CPU tensor exists here; a GPU tensor takes the same ``.cpu()`` path.
    """
    import torch  # part of every SGLang venv: an ImportError is a failure
    # Decode page 2 must hold prefill page 0; page 1 must keep the sentinel.
    exp = patterns.PoolExpectation(pool_id=0, name="kv", num_pages=3, writes={2: 0}, sentinel_pages=[1])
    item = 8
    good = np.full((3, item), patterns.SENTINEL, dtype=np.uint8)
    good[2] = patterns.page_bytes(0, 0, 0, item)
    assert patterns.compare_buffer(torch.from_numpy(good.copy()), 0, 0, exp, "kv buffer 0") == []
    bad = good.copy()
    bad[1, 3] = 0
    lines = patterns.compare_buffer(torch.from_numpy(bad), 0, 0, exp, "kv buffer 0")
    assert len(lines) == 1 and "page 1: must be untouched" in lines[0]
    assert patterns.host_bytes(torch.from_numpy(good)).dtype == np.uint8
