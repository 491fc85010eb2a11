"""Pure command building for launch_pd: argument vectors per release, validation.

Expected argument vectors are written out by hand from SGLang's PD test fixture
flags (sglang/test/server_fixtures/disaggregation_fixture.py) and the release
table (0.5.10.post1 has no plugin framework, so its servers start through the
plugin's launcher).
"""

import pytest

from sglang_disagg_ext.deploy import DeployError
from sglang_disagg_ext.deploy import commands as cmds
from sglang_disagg_ext.releases import policy_for

PY = "/opt/venv/bin/python"


def opts(**kw):
    base = dict(model_path="/models/llama", prefill_port=30000, decode_port=30001,
                bootstrap_port=8998, router_port=8000)
    base.update(kw)
    return cmds.PDOptions(**base)


def expected_server(module, mode, port, tp, gpu, extra=()):
    return [PY, "-m", module, "--model-path", "/models/llama",
            "--disaggregation-mode", mode, "--disaggregation-bootstrap-port", "8998",
            "--tp-size", str(tp), "--base-gpu-id", str(gpu),
            "--disaggregation-transfer-backend", "mooncake-ext",
            "--host", "127.0.0.1", "--port", str(port), *extra]


MINI_LB = [PY, "-m", "sglang_disagg_ext.deploy.mini_lb", "--prefill", "http://127.0.0.1:30000", "8998",
           "--decode", "http://127.0.0.1:30001", "--host", "127.0.0.1", "--port", "8000"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "release,module",
    [
        ("0.5.10.post1", "sglang_disagg_ext.launch_server"),
        ("0.5.11", "sglang.launch_server"),
        ("0.5.12.post1", "sglang.launch_server"),
        ("0.5.23", "sglang.launch_server"),
    ],
)
def test_three_commands_per_release(release, module):
    o = opts(prefill_tp=2, decode_tp=1)
    assert cmds.validate_pd_options(o) == []
    specs = cmds.build_pd_servers(o, cmds.ServerRuntime(PY, cmds.resolve_server_module(policy_for(release), o.backend)))
    assert [s.name for s in specs] == ["prefill", "decode", "router"]
    assert specs[0].argv == expected_server(module, "prefill", 30000, 2, 0)
    # decode starts on the first GPU after prefill's two
    assert specs[1].argv == expected_server(module, "decode", 30001, 1, 2)
    assert specs[2].argv == MINI_LB
    assert [s.health_url for s in specs] == [
        "http://127.0.0.1:30000/health", "http://127.0.0.1:30001/health", "http://127.0.0.1:8000/health"]
    assert all(s.env == {} for s in specs)


@pytest.mark.timeout(30)
def test_sglang_router_ib_device_and_extra_args():
    o = opts(router="sglang-router", ib_device="mlx5_0", decode_base_gpu_id=4,
             prefill_extra_args=("--mem-fraction-static", "0.5"), decode_extra_args=("--page-size", "16"),
             trust_remote_code=True)
    specs = cmds.build_pd_servers(o, cmds.ServerRuntime(PY, "sglang.launch_server"))
    assert specs[0].argv == [
        PY, "-m", "sglang.launch_server", "--model-path", "/models/llama", "--trust-remote-code",
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "8998",
        "--tp-size", "1", "--base-gpu-id", "0", "--disaggregation-transfer-backend", "mooncake-ext",
        "--disaggregation-ib-device", "mlx5_0", "--host", "127.0.0.1", "--port", "30000",
        "--mem-fraction-static", "0.5"]
    assert specs[1].argv == [
        PY, "-m", "sglang.launch_server", "--model-path", "/models/llama", "--trust-remote-code",
        "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "8998",
        "--tp-size", "1", "--base-gpu-id", "4", "--disaggregation-transfer-backend", "mooncake-ext",
        "--disaggregation-ib-device", "mlx5_0", "--host", "127.0.0.1", "--port", "30001",
        "--page-size", "16"]
    assert specs[2].argv == [PY, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                             "--prefill", "http://127.0.0.1:30000", "8998",
                             "--decode", "http://127.0.0.1:30001", "--host", "127.0.0.1", "--port", "8000"]


@pytest.mark.timeout(30)
def test_tcp_sets_mooncake_env_and_shell_line_shows_it():
    o = opts(protocol="tcp")
    prefill, decode, router = cmds.build_pd_servers(o, cmds.ServerRuntime(PY, "sglang.launch_server"))
    assert prefill.env == decode.env == {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp"}
    assert router.env == {}
    assert prefill.shell_line() == "MC_FORCE_TCP=1 MOONCAKE_PROTOCOL=tcp " + " ".join(
        expected_server("sglang.launch_server", "prefill", 30000, 1, 0))


@pytest.mark.timeout(30)
def test_bind_all_host_is_reached_on_loopback_and_ipv6_is_bracketed():
    assert cmds.base_url("0.0.0.0", 30000) == "http://127.0.0.1:30000"
    assert cmds.base_url("::1", 30000) == "http://[::1]:30000"
    assert cmds.base_url("node7", 8000) == "http://node7:8000"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(decode_port=30000), "--decode-port and --prefill-port are both 30000"),
        (dict(router_port=70000), "--router-port must be a TCP port between 1 and 65535, got 70000"),
        (dict(prefill_tp=0), "--prefill-tp must be a positive integer, got 0"),
        (dict(backend="mooncake-fast"), "unknown transfer backend 'mooncake-fast'"),
        (dict(protocol="tcp", backend="nixl-ext"), "--protocol tcp applies to the Mooncake backends only"),
        (dict(protocol="tcp", ib_device="mlx5_0"), "cannot be combined with --protocol tcp"),
        (dict(model_path=""), "--model-path is required"),
    ],
)
def test_bad_options_are_named(kw, needle):
    with pytest.raises(DeployError) as err:
        cmds.validate_pd_options(opts(**kw))
    assert needle in str(err.value)


@pytest.mark.timeout(30)
def test_overlapping_gpus_warn():
    assert cmds.validate_pd_options(opts(decode_base_gpu_id=0)) == [
        "prefill GPUs 0..0 and decode GPUs 0..0 overlap; give both servers a --mem-fraction-static that fits together"]


@pytest.mark.timeout(30)
def test_unsupported_release_refuses_ext_but_not_stock():
    with pytest.raises(DeployError) as err:
        cmds.resolve_server_module(policy_for("0.5.9"), "mooncake-ext")
    assert "does not support SGLang 0.5.9" in str(err.value)
    assert cmds.resolve_server_module(policy_for("0.5.9"), "mooncake") == "sglang.launch_server"


@pytest.mark.timeout(30)
def test_router_choice():
    assert cmds.choose_router("auto", router_installed=True) == "sglang-router"
    assert cmds.choose_router("auto", router_installed=False) == "mini-lb"
    assert cmds.choose_router("mini-lb", router_installed=True) == "mini-lb"
    with pytest.raises(DeployError):
        cmds.choose_router("nginx", router_installed=False)


@pytest.mark.timeout(30)
def test_colocated_server():
    spec = cmds.build_colocated_server("/models/llama", 30010, PY, tp=2, base_gpu_id=2,
                                       extra_args=["--load-format", "dummy"])
    assert spec.argv == [PY, "-m", "sglang.launch_server", "--model-path", "/models/llama",
                         "--tp-size", "2", "--base-gpu-id", "2", "--host", "127.0.0.1", "--port", "30010",
                         "--load-format", "dummy"]
    assert spec.url == "http://127.0.0.1:30010"
