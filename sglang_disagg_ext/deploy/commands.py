"""Pure command building for a 1P1D deployment: argument vectors, validation, no processes.

The server flags mirror SGLang's own PD test fixture
(``sglang/test/server_fixtures/disaggregation_fixture.py``): ``--disaggregation-mode``,
``--disaggregation-bootstrap-port``, ``--tp-size``, ``--base-gpu-id``,
``--disaggregation-transfer-backend``, ``--disaggregation-ib-device``, ``--host``, ``--port``.
The router takes ``--prefill URL BOOTSTRAP_PORT --decode URL`` in both forms
(``sglang_router.launch_router --pd-disaggregation`` and the in-tree mini load balancer).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_disagg_ext.deploy import DeployError
from sglang_disagg_ext import backend_table
from sglang_disagg_ext.releases import EXT_BACKENDS, ReleasePolicy, UnsupportedSGLangRelease

STOCK_BACKENDS = backend_table.NAMES
KNOWN_BACKENDS = tuple(EXT_BACKENDS) + STOCK_BACKENDS
PROTOCOLS = ("rdma", "tcp")
DEVICES = ("cuda", "cpu")
ROUTERS = ("sglang-router", "mini-lb")

ROUTER_MODULE = "sglang_router.launch_router"
MINI_LB_MODULE = "sglang_disagg_ext.deploy.mini_lb"
STOCK_SERVER_MODULE = "sglang.launch_server"

# Mooncake reads MC_FORCE_TCP itself (SGLang 0.5.10/0.5.11 hard-code "rdma");
# SGLang 0.5.12+ reads MOONCAKE_PROTOCOL. Setting both covers every release.
TCP_ENV = {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp"}

# --device cpu: SGLang's own switches for serving on a CPU (a tiny model, trying PD before a
# GPU cluster). SGLANG_USE_CPU_ENGINE=1: is_cpu() needs it besides --device cpu (0.5.23
# srt/utils/common.py:221-224). The cached-prefix early send records a torch.cuda.Event
# (0.5.23 prefill.py:1494-1496); 0 turns it off (a no-op on releases without it). No
# --base-gpu-id: on a CPU it picks a NUMA node, and decode's "1" is out of range on one.
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_PREFILL_ENV = {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}
CPU_SERVER_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                   "--skip-server-warmup", "--sleep-on-idle")
# Decode's default retraction backup is a pinned host pool (torch.cuda.cudart(), 0.5.23
# kv_cache_builder.py:227-241); releases with the flag take a plain CPU tensor instead.
CPU_DECODE_BACKUP_ARGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")


@dataclasses.dataclass
class ServerSpec:
    """One process to start: its argument vector, extra environment and where it answers."""

    name: str
    argv: List[str]
    url: str
    port: int
    env: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def health_url(self) -> str:
        return self.url + "/health"

    def shell_line(self) -> str:
        """The command as one shell line; extra environment as ``NAME=value`` prefixes."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join(prefix + [shlex.join(self.argv)])


@dataclasses.dataclass(frozen=True)
class ServerRuntime:
    """The Python environment a server runs from: its interpreter, the module run as the server
    (``resolve_server_module``) and that environment's SGLang release with the one switch the
    commands depend on. Prefill and decode may have different ones (``launch-pd --prefill-python``
    / ``--decode-python``: a rolling upgrade rehearsed on one host)."""

    python: str
    server_module: str
    sglang_version: Optional[str] = None
    # --device cpu: whether this release's ServerArgs has --disaggregation-decode-retraction-backup.
    decode_backup_flag: bool = False


@dataclasses.dataclass
class PDOptions:
    model_path: str
    prefill_port: int
    decode_port: int
    bootstrap_port: int
    router_port: int
    backend: str = "mooncake-ext"
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_base_gpu_id: int = 0
    decode_base_gpu_id: Optional[int] = None  # None: the first GPU after prefill's
    host: str = "127.0.0.1"
    ib_device: Optional[str] = None
    protocol: str = "rdma"
    trust_remote_code: bool = False
    prefill_extra_args: Tuple[str, ...] = ()
    decode_extra_args: Tuple[str, ...] = ()
    router: str = "mini-lb"
    device: str = "cuda"
    # sglang_router's Prometheus exporter port (its default, 29000, is taken by a second router
    # on the same host); None: the router's default.
    router_metrics_port: Optional[int] = None

    @property
    def decode_gpu(self) -> int:
        if self.decode_base_gpu_id is None:
            return self.prefill_base_gpu_id + self.prefill_tp
        return self.decode_base_gpu_id

    def gpus_needed(self) -> int:
        """Highest GPU index used plus one (0 on a CPU)."""
        if self.device == "cpu":
            return 0
        return max(self.prefill_base_gpu_id + self.prefill_tp, self.decode_gpu + self.decode_tp)


def connect_host(host: str) -> str:
    """The address clients use to reach a server bound to ``host`` (URL form)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    except ValueError:
        pass  # a host name
    return host


def base_url(host: str, port: int) -> str:
    return f"http://{connect_host(host)}:{port}"


def _check_port(what: str, port) -> None:
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise DeployError(f"{what} must be a TCP port between 1 and 65535, got {port!r}")


def validate_pd_options(opts: PDOptions) -> List[str]:
    """Raise DeployError for options that cannot work; return warnings for risky ones."""
    if not opts.model_path:
        raise DeployError("--model-path is required (a local model folder or a Hugging Face Hub id)")
    if opts.backend not in KNOWN_BACKENDS:
        raise DeployError(
            f"unknown transfer backend {opts.backend!r}; choose one of {', '.join(KNOWN_BACKENDS)}"
        )
    for what, tp in (("--prefill-tp", opts.prefill_tp), ("--decode-tp", opts.decode_tp)):
        if not isinstance(tp, int) or tp < 1:
            raise DeployError(f"{what} must be a positive integer, got {tp!r}")
    for what, gpu in (("--prefill-base-gpu-id", opts.prefill_base_gpu_id),
                      ("--decode-base-gpu-id", opts.decode_gpu)):
        if not isinstance(gpu, int) or gpu < 0:
            raise DeployError(f"{what} must be a GPU index >= 0, got {gpu!r}")
    ports = {
        "--prefill-port": opts.prefill_port,
        "--decode-port": opts.decode_port,
        "--bootstrap-port": opts.bootstrap_port,
        "--router-port": opts.router_port,
    }
    if opts.router_metrics_port is not None:
        ports["--router-metrics-port"] = opts.router_metrics_port
    for what, port in ports.items():
        _check_port(what, port)
    seen: Dict[int, str] = {}
    for what, port in ports.items():
        if port in seen:
            raise DeployError(f"{what} and {seen[port]} are both {port}; every server needs its own port")
        seen[port] = what
    if opts.protocol not in PROTOCOLS:
        raise DeployError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {opts.protocol!r}")
    base = EXT_BACKENDS.get(opts.backend, opts.backend)
    if opts.protocol == "tcp":
        if base != "mooncake":
            raise DeployError(
                f"--protocol tcp applies to the Mooncake backends only (got {opts.backend}); "
                "NIXL chooses its transport through UCX_TLS"
            )
        if opts.ib_device:
            raise DeployError("--ib-device names an RDMA device; it cannot be combined with --protocol tcp")
    if opts.router not in ROUTERS:
        raise DeployError(f"--router must be one of {', '.join(ROUTERS)}, got {opts.router!r}")
    if opts.device not in DEVICES:
        raise DeployError(f"--device must be one of {', '.join(DEVICES)}, got {opts.device!r}")
    if opts.device == "cpu" and (opts.prefill_tp, opts.decode_tp) != (1, 1):
        raise DeployError("--device cpu runs one process per server: --prefill-tp and --decode-tp must be 1")

    warnings = []
    if opts.device == "cpu":
        return warnings
    p0, p1 = opts.prefill_base_gpu_id, opts.prefill_base_gpu_id + opts.prefill_tp
    d0, d1 = opts.decode_gpu, opts.decode_gpu + opts.decode_tp
    if p0 < d1 and d0 < p1:
        warnings.append(
            f"prefill GPUs {p0}..{p1 - 1} and decode GPUs {d0}..{d1 - 1} overlap; "
            "give both servers a --mem-fraction-static that fits together"
        )
    return warnings


def resolve_server_module(policy: ReleasePolicy, backend: str) -> str:
    """``sglang.launch_server``, or the plugin's launcher where SGLang cannot load the plugin."""
    if backend not in EXT_BACKENDS:
        return STOCK_SERVER_MODULE
    try:
        policy.check_supported()
    except UnsupportedSGLangRelease as exc:
        raise DeployError(str(exc)) from None
    return policy.server_module


def _pd_server(opts: PDOptions, runtime: ServerRuntime, mode: str) -> ServerSpec:
    port = opts.prefill_port if mode == "prefill" else opts.decode_port
    tp = opts.prefill_tp if mode == "prefill" else opts.decode_tp
    gpu = opts.prefill_base_gpu_id if mode == "prefill" else opts.decode_gpu
    argv = [runtime.python, "-m", runtime.server_module, "--model-path", opts.model_path]
    if opts.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += [
        "--disaggregation-mode", mode,
        "--disaggregation-bootstrap-port", str(opts.bootstrap_port),
        "--tp-size", str(tp),
    ]
    if opts.device != "cpu":
        argv += ["--base-gpu-id", str(gpu)]
    argv += ["--disaggregation-transfer-backend", opts.backend]
    if opts.ib_device:
        argv += ["--disaggregation-ib-device", opts.ib_device]
    argv += ["--host", opts.host, "--port", str(port)]
    env = dict(TCP_ENV) if opts.protocol == "tcp" else {}
    if opts.device == "cpu":
        argv += list(CPU_SERVER_ARGS)
        if mode == "decode" and runtime.decode_backup_flag:
            argv += list(CPU_DECODE_BACKUP_ARGS)
        env.update(CPU_ENV)
        if mode == "prefill":
            env.update(CPU_PREFILL_ENV)
    argv += list(opts.prefill_extra_args if mode == "prefill" else opts.decode_extra_args)
    return ServerSpec(mode, argv, base_url(opts.host, port), port, env)


def router_spec(opts: PDOptions, python: str) -> ServerSpec:
    module = ROUTER_MODULE if opts.router == "sglang-router" else MINI_LB_MODULE
    argv = [python, "-m", module]
    if opts.router == "sglang-router":
        argv.append("--pd-disaggregation")
        if opts.router_metrics_port is not None:
            argv += ["--prometheus-host", opts.host, "--prometheus-port", str(opts.router_metrics_port)]
    argv += [
        "--prefill", base_url(opts.host, opts.prefill_port), str(opts.bootstrap_port),
        "--decode", base_url(opts.host, opts.decode_port),
        "--host", opts.host,
        "--port", str(opts.router_port),
    ]
    return ServerSpec("router", argv, base_url(opts.host, opts.router_port), opts.router_port)


def build_pd_servers(opts: PDOptions, prefill: ServerRuntime, decode: Optional[ServerRuntime] = None,
                     router_python: Optional[str] = None) -> List[ServerSpec]:
    """Prefill, decode and router, in start order. Call ``validate_pd_options`` first.
    ``decode`` defaults to prefill's runtime, ``router_python`` to prefill's interpreter."""
    return [
        _pd_server(opts, prefill, "prefill"),
        _pd_server(opts, decode or prefill, "decode"),
        router_spec(opts, router_python or prefill.python),
    ]


def build_colocated_server(
    model_path: str,
    port: int,
    python: str,
    tp: int = 1,
    base_gpu_id: int = 0,
    host: str = "127.0.0.1",
    trust_remote_code: bool = False,
    extra_args: Sequence[str] = (),
    device: str = "cuda",
) -> ServerSpec:
    """One ordinary (non-PD) SGLang server: the reference a PD run is compared with.

    ``device="cpu"`` gives it the same CPU switches as ``launch-pd --device cpu``'s servers."""
    if not isinstance(tp, int) or tp < 1:
        raise DeployError(f"colocated --tp must be a positive integer, got {tp!r}")
    if device not in DEVICES:
        raise DeployError(f"colocated --device must be one of {', '.join(DEVICES)}, got {device!r}")
    _check_port("colocated --port", port)
    argv = [python, "-m", STOCK_SERVER_MODULE, "--model-path", model_path]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    argv += ["--tp-size", str(tp)]
    if device != "cpu":
        argv += ["--base-gpu-id", str(base_gpu_id)]
    argv += ["--host", host, "--port", str(port)]
    env = {}
    if device == "cpu":
        argv += list(CPU_SERVER_ARGS)
        env.update(CPU_ENV)
    argv += list(extra_args)
    return ServerSpec("colocated", argv, base_url(host, port), port, env)


def choose_router(requested: str, router_installed: bool) -> str:
    """``auto`` becomes ``sglang-router`` when it is installed, else the in-tree ``mini-lb``."""
    if requested == "auto":
        return "sglang-router" if router_installed else "mini-lb"
    if requested not in ROUTERS:
        raise DeployError(f"--router must be auto, {' or '.join(ROUTERS)}; got {requested!r}")
    return requested
