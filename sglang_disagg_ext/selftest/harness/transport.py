"""Where the harness puts its pools and how its engines talk: pure, no SGLang or torch import.

``selftest --protocol/--device/--ib-device`` arrive here as :class:`TransferOptions`
and travel unchanged to every worker child (``--protocol``, ``--device``,
``--ib-device``), which builds its pools on ``device`` and starts its engine
with ``protocol``. What each option means per engine:

* Mooncake: ``protocol`` is the TransferEngine protocol. SGLang 0.5.10-0.5.12
  hard-code ``"rdma"`` in their engine wrapper and only Mooncake's own
  ``MC_FORCE_TCP=1`` turns it into TCP; 0.5.13+ read ``MOONCAKE_PROTOCOL``
  (default ``rdma``). The children get both, as an operator would set them, so
  every release does what it does in production. ``ib_device`` goes to
  ``ServerArgs.disaggregation_ib_device`` (SGLang hands it to the engine).
  Mooncake with protocol ``rdma`` and no usable HCA does not fail: it installs
  its TCP transport and returns 0 (measured with 0.3.13.post1). The worker
  therefore checks the engine's local topology and stops with "RDMA init
  failed" rather than report a TCP run as RDMA (:func:`mooncake_hcas`).
* NIXL: the UCX backend picks its transport itself from ``UCX_TLS``;
  ``protocol`` selects that list (:func:`ucx_tls`): ``tcp`` is TCP plus the
  intra-node transports, ``rdma`` is the InfiniBand/RoCE transports without
  shared memory, so a one-node selftest cannot pass through shared memory and
  call it RDMA. ``ib_device`` becomes ``UCX_NET_DEVICES``. With ``UCX_TLS``
  holding no usable transport the NIXL agent fails to create its UCX backend
  (``NIXL_ERR_BACKEND``), a definite error.
* MoRI: SGLang's MoRI backend configures its IO engine itself (RDMA); the
  in-repo stand-in engine copies host memory only, so its rows are "n/a"
  for anything but CPU over the default protocol.

Aux (metadata) buffers stay in host memory whatever ``device`` says: SGLang's
``MetadataBuffers`` allocates them on the CPU (NPU aside) and the harness uses
that class.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

PROTOCOLS = ("tcp", "rdma")
DEFAULT_PROTOCOL = "tcp"
DEFAULT_DEVICE = "cpu"

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


class TransportOptionError(ValueError):
    """An option value the harness cannot act on, whatever the machine."""


def parse_device(text: str) -> Tuple[str, Optional[int]]:
    """``"cpu"`` -> ("cpu", None); ``"cuda"`` -> ("cuda", 0); ``"cuda:N"`` -> ("cuda", N)."""
    m = _DEVICE_RE.match(str(text).strip())
    if not m or (m.group(1) == "cpu" and m.group(2) is not None):
        raise TransportOptionError(f"--device {text!r}: expected cpu, cuda or cuda:N (N a GPU index)")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        return "cpu", None
    return "cuda", int(index) if index is not None else 0


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    protocol: str = DEFAULT_PROTOCOL
    device: str = DEFAULT_DEVICE
    ib_device: Optional[str] = None

    def validated(self) -> "TransferOptions":
        """Checked and normalised (``cuda`` becomes ``cuda:0``); raises TransportOptionError."""
        protocol = str(self.protocol).strip().lower()
        if protocol not in PROTOCOLS:
            raise TransportOptionError(f"--protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        kind, index = parse_device(self.device)
        ib = (self.ib_device or "").strip() or None
        if ib is not None and protocol != "rdma":
            raise TransportOptionError(
                f"--ib-device {ib!r} names an RDMA device; it applies only with --protocol rdma "
                f"(asked: --protocol {protocol})"
            )
        device = "cpu" if kind == "cpu" else f"cuda:{index}"
        return TransferOptions(protocol=protocol, device=device, ib_device=ib)

    @property
    def device_type(self) -> str:
        return parse_device(self.device)[0]

    @property
    def gpu_index(self) -> int:
        """The GPU index SGLang's ``gpu_id`` carries (0 for CPU pools, as the harness always had)."""
        index = parse_device(self.device)[1]
        return 0 if index is None else index

    @property
    def is_default(self) -> bool:
        v = self.validated()
        return v.protocol == DEFAULT_PROTOCOL and v.device == DEFAULT_DEVICE and v.ib_device is None

    def worker_args(self) -> List[str]:
        args = ["--protocol", self.protocol, "--device", self.device]
        if self.ib_device:
            args += ["--ib-device", self.ib_device]
        return args

    def describe(self) -> str:
        ib = f", ib device {self.ib_device}" if self.ib_device else ""
        return f"protocol {self.protocol}, pools on {self.device}{ib}"


def ucx_tls(protocol: str, device_type: str) -> str:
    """``UCX_TLS`` for NIXL's UCX backend.

    ``cuda_copy`` is added for GPU pools: UCX needs it to move device memory
    on any network transport.
    """
    tls = "tcp,self,sm" if protocol == "tcp" else "rc,ud,self"
    return tls + (",cuda_copy" if device_type == "cuda" else "")


def ucx_net_devices(ib_device: str) -> str:
    """``mlx5_0,mlx5_1`` -> ``mlx5_0:1,mlx5_1:1`` (UCX names a port; a given port is kept)."""
    out = []
    for name in ib_device.split(","):
        name = name.strip()
        if name:
            out.append(name if ":" in name else f"{name}:1")
    return ",".join(out)


def engine_env(options: TransferOptions) -> Tuple[Dict[str, str], Tuple[str, ...]]:
    """(variables to set, variables to remove) in a worker child's environment.

    A parent environment with ``MC_FORCE_TCP`` set would silently turn an
    RDMA request into TCP, so ``rdma`` removes it.
    """
    opts = options.validated()
    set_vars = {
        "MOONCAKE_PROTOCOL": opts.protocol,
        "SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX",
        "UCX_TLS": ucx_tls(opts.protocol, opts.device_type),
    }
    unset: List[str] = []
    if opts.protocol == "tcp":
        set_vars["MC_FORCE_TCP"] = "1"
        unset.append("UCX_NET_DEVICES")
    else:
        unset.append("MC_FORCE_TCP")
        if opts.ib_device:
            set_vars["UCX_NET_DEVICES"] = ucx_net_devices(opts.ib_device)
        else:
            unset.append("UCX_NET_DEVICES")
    if opts.device_type == "cpu":
        # A CUDA build of torch on a GPU node would otherwise put SGLang's
        # process-group tensors on a GPU the CPU pools never use.
        set_vars["CUDA_VISIBLE_DEVICES"] = ""
    return set_vars, tuple(unset)


# -- what the engine really did -------------------------------------------------------------


def mooncake_hcas(topology_json: str) -> List[str]:
    """RDMA devices in Mooncake's ``TransferEngine.get_local_topology()`` answer.

    The answer maps each memory location (``cpu:0``, ``cuda:0`` ...) to
    ``[preferred HCAs, other HCAs]``; with no RDMA device every list is empty
    (``{"cpu:0": [[], []]}``) or the map is empty (``{}``).
    """
    import json

    try:
        topo = json.loads(topology_json) if topology_json.strip() else {}
    except ValueError as exc:
        raise ValueError(f"Mooncake topology is not JSON: {topology_json[:200]!r}") from exc
    if not isinstance(topo, dict):
        raise ValueError(f"Mooncake topology is not a JSON object: {topology_json[:200]!r}")
    seen: List[str] = []
    for lists in topo.values():
        for group in lists if isinstance(lists, list) else []:
            for hca in group if isinstance(group, list) else []:
                if isinstance(hca, str) and hca not in seen:
                    seen.append(hca)
    return seen


def mooncake_transport(protocol_arg: Optional[str], force_tcp: bool, hcas: Optional[List[str]]) -> Optional[str]:
    """The transport Mooncake installs for ``initialize(..., protocol_arg, ...)``.

    Mooncake's rule: ``MC_FORCE_TCP`` or protocol ``tcp`` -> TCP; protocol
    ``rdma`` with at least one HCA -> RDMA, with none -> TCP (its fallback).
    Other protocols (efa, ascend, ...) are returned as given.
    """
    if protocol_arg is None:
        return None
    if force_tcp or protocol_arg == "tcp":
        return "tcp"
    if protocol_arg == "rdma":
        return "rdma" if hcas else "tcp"
    return protocol_arg


def rdma_init_failure(engine: str, ib_device: Optional[str], why: str) -> str:
    """The one wording of an RDMA start failure (tests and operators grep for it)."""
    tried = ib_device if ib_device else "none given (auto-discovery)"
    return f"RDMA init failed: {engine}: {why} (ib device tried: {tried})"
