"""Every SGLang-release difference the harness worker meets, in one place.

The worker (``worker.py``) builds the same objects SGLang's prefill and decode
schedulers build -- ``ServerArgs``, process groups (one per side and rank), the shared Mooncake
engine, KV pool, metadata buffers, ``KVArgs``, the backend's manager, sender and
receiver -- and asks this module how to do each step on the installed release.
Release facts come from ``sglang_disagg_ext.releases`` (state layout) and from
its feature probes (``releases.features()``); nothing else in the harness
compares versions or probes SGLang's code.

References (``file:line`` in the release named):
  * KVArgs filling: ``disaggregation/prefill.py::_init_kv_manager`` and
    ``disaggregation/decode.py::_init_kv_manager`` (0.5.11 prefill.py:142,
    decode.py:329; 0.5.12.post1 prefill.py:143 with ``setup_state_kv_args``
    from ``disaggregation/utils.py:552``).
  * Shared Mooncake engine: ``model_executor/model_runner.py`` starts it only
    when the backend string equals ``"mooncake"`` (0.5.11 :1277).
  * Process groups: ``init_distributed_environment``, ``initialize_model_parallel``,
    ``initialize_dp_attention`` (every release's CommonKVManager reads the
    attention TP/CP/DP getters and, on prefill, ``get_pp_group()``); 0.5.17+
    publish the config first (``runtime_context.publish``), 0.5.23 with the rank
    placement (managers/scheduler.py:6327), and size the groups from it.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from sglang_disagg_ext import releases

EXT_BACKENDS = releases.EXT_BACKENDS


# -- environment -----------------------------------------------------------------


def transfer_env(timeouts, host_ip: str = "127.0.0.1", options=None) -> Dict[str, str]:
    """Environment for a worker child: engines on loopback, short timeouts.

    Protocol and device variables come from ``options``
    (``transport.engine_env``; default TCP and CPU pools). Mooncake: 0.5.13+
    read ``MOONCAKE_PROTOCOL`` (default rdma); 0.5.10-0.5.12 hard-code rdma
    and only Mooncake's own ``MC_FORCE_TCP`` switches it. Both are set: each
    release ignores the one it does not read. Variables ``engine_env`` says to
    remove are the caller's to drop (``run.child_env``).
    """
    from .transport import TransferOptions, engine_env

    engine_vars, _ = engine_env(options or TransferOptions())
    env = {
        "SGLANG_HOST_IP": host_ip,
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": _num(timeouts.sglang_waiting_s),
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": _num(timeouts.sglang_bootstrap_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": _num(timeouts.heartbeat_interval_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(int(timeouts.heartbeat_max_failure)),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(engine_vars)
    return env


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def model_config_json(scn) -> Dict[str, Any]:
    """A tiny llama ``config.json``: ServerArgs needs a local model directory."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": scn.hidden_size,
        "intermediate_size": 2 * scn.hidden_size,
        "num_attention_heads": scn.kv.head_num,
        "num_key_value_heads": scn.kv.head_num,
        "head_dim": scn.kv.head_dim,
        "num_hidden_layers": scn.num_layers,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": scn.kv.dtype,
    }


# -- release facts -----------------------------------------------------------------


def sglang_version() -> Optional[str]:
    return releases.installed_sglang_version()


def state_layout() -> releases.StateLayout:
    layout = releases.current_policy().layout
    if layout is None:
        raise RuntimeError(
            f"the harness does not know SGLang {sglang_version()!r}'s state layout "
            "(see sglang_disagg_ext.releases)"
        )
    return layout


def is_flat() -> bool:
    return state_layout() is releases.StateLayout.FLAT


# -- plugin -----------------------------------------------------------------------


def load_plugin(mode: str, backend: str) -> Optional[str]:
    """Load the plugin the way SGLang would; returns what was called, or None.

    ``mode``: "yes", "no", or "auto" (load it when ``backend`` is an -ext name).
    """
    want = mode == "yes" or (mode == "auto" and backend in EXT_BACKENDS)
    if not want:
        return None
    try:
        from sglang_disagg_ext.registration import load_plugin as _load
    except ImportError as e:
        raise RuntimeError(
            f"backend {backend!r} needs sglang_disagg_ext.registration.load_plugin: {e}"
        ) from e
    _load()
    return "sglang_disagg_ext.registration.load_plugin"


# -- server args, groups, engines ---------------------------------------------------------


def make_server_args(
    model_dir: str,
    role: str,
    backend: str,
    bootstrap_port: int,
    page_size: int,
    tp_size: int = 1,
    device: str = "cpu",
    ib_device: Optional[str] = None,
):
    """``device``: ``cpu`` or ``cuda[:N]`` (ServerArgs takes the device type; the
    index is SGLang's ``gpu_id``). ``ib_device``: ``--disaggregation-ib-device``."""
    from sglang.srt.server_args import ServerArgs

    extra = {"tp_size": tp_size} if tp_size != 1 else {}  # multi-rank scenarios (harness.ranks)
    if ib_device:
        extra["disaggregation_ib_device"] = ib_device
    server_args = ServerArgs(
        **extra,
        model_path=model_dir,
        skip_tokenizer_init=True,
        device=device.split(":")[0],
        disaggregation_mode=role,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=bootstrap_port,
        host="127.0.0.1",
        page_size=page_size,
    )
    # 0.5.13+ check their arguments (the IB device among them) when resolved, not
    # when built; resolving here makes every release refuse bad arguments at this
    # step, as the launcher does before any process starts. Idempotent there.
    if releases.features().server_args_resolve_once:
        server_args.resolve_once()
    return server_args


def init_runtime(
    server_args,
    dist_init_method: str,
    hidden_size: int,
    dtype,
    rank: int = 0,
    world_size: int = 1,
    gpu_id: Optional[int] = None,
) -> None:
    """Real process groups, as the release's scheduler builds them (one rank by default).

    Every release's ``CommonKVManager`` reads the attention TP/CP/DP getters and
    (prefill) ``get_pp_group()``, which assert unless real groups exist.
    With ``world_size`` > 1 (multi-rank scenarios): this process is TP rank
    ``rank`` of a real gloo group of that size, one process per rank, on
    every release (0.5.13+: through ``runtime_context``, see
    ``_init_runtime_context``).
    ``gpu_id`` (GPU pools): the CUDA device this process uses. SGLang's group
    coordinator puts its tensors on ``cuda:<local_rank>``, so ``local_rank`` is
    that index: every rank of a harness run shares the one GPU asked for.
    """
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    if gpu_id is not None:
        import torch

        torch.cuda.set_device(gpu_id)
    features = releases.features()
    if features.runtime_context_publish and features.runtime_context_spawn_ranks:
        _init_runtime_context(server_args, dist_init_method, rank=rank, world_size=world_size, gpu_id=gpu_id)
        return
    if features.runtime_context_publish:
        # Config published without ranks (0.5.17/0.5.18's run_scheduler_process:
        # ``publish(server_args, role="scheduler")``); the groups below get their
        # widths from arguments, as before runtime_context existed.
        from sglang.srt import runtime_context as rc

        rc.publish(server_args, role="scheduler")
    else:
        # No runtime_context, or one without ``publish`` (0.5.14-0.5.16, whose
        # scheduler still calls this function).
        set_global_server_args_for_scheduler(server_args)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    ps.set_custom_all_reduce(False)
    ps.init_distributed_environment(
        world_size=world_size,
        rank=rank,
        local_rank=rank if gpu_id is None else gpu_id,
        backend="gloo",
        distributed_init_method=dist_init_method,
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    # initialize_dp_attention reads only hidden_size and dtype of the model config
    # (and, where runtime_context exists, hf_config's optional hybrid_override_pattern).
    initialize_dp_attention(server_args, SimpleNamespace(hidden_size=hidden_size, dtype=dtype, hf_config=SimpleNamespace()))


def _init_runtime_context(
    server_args, dist_init_method: str, rank: int = 0, world_size: int = 1, gpu_id: Optional[int] = None
) -> None:
    """0.5.13+: publish the config with this rank's placement, then real groups.

    Mirrors ``managers/scheduler.py::run_scheduler_process`` (0.5.23 :6327:
    ``publish(..., ranks=SpawnRanks(world_rank=spawn_world_rank(tp_rank,
    pp_rank), gpu_id=...))``) and ``distributed/bootstrap.py::_init_parallel_groups``
    (0.5.23 :304: ``init_distributed_environment(world_size=tp*pp,
    rank=tp_size*pp_rank+tp_rank, local_rank=gpu_id)``, then
    ``initialize_model_parallel()`` and ``initialize_dp_attention``, whose
    widths come from the published context, not from arguments).

    ``server_args.tp_size`` must equal ``world_size`` (``make_server_args``
    sets it): publish derives this process's TP/attention ranks from the
    configured widths and the world rank, and ``initialize_model_parallel``
    checks the gloo world against them. ``gpu_id`` None (CPU pools): the
    device index is the TP rank, what the launcher hands a CPU scheduler
    (``base_gpu_id + tp_rank * gpu_id_step``); the group coordinator uses
    ``local_rank`` only to pick a device, the CPU there. With a GPU, every
    rank uses the one GPU asked for (see ``init_runtime``).
    """
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    configured = getattr(server_args, "tp_size", 1)
    if configured != world_size:
        raise ValueError(f"harness rank {rank}: ServerArgs tp_size is {configured}, the gloo world has {world_size}")
    device_index = rank if gpu_id is None else gpu_id
    world_rank = rc.spawn_world_rank(server_args, tp_rank=rank, pp_rank=0)
    rc.publish(
        server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=world_rank, dp_rank=None, gpu_id=device_index)
    )
    # The scheduler sets this from --disable-custom-all-reduce (bootstrap.py
    # _set_all_reduce_flags); gloo groups, and every rank of a GPU run shares
    # one device, so no custom all-reduce, as on older releases.
    ps.set_custom_all_reduce(False)
    ps.init_distributed_environment(
        backend="gloo",
        world_size=world_size,
        rank=world_rank,
        local_rank=device_index,
        distributed_init_method=dist_init_method,
    )
    ps.initialize_model_parallel()
    initialize_dp_attention(server_args=server_args)


# Arguments each ``mooncake.engine.TransferEngine.initialize`` call got in this
# process, in order (see ``_record_mooncake_initialize``).
_MOONCAKE_INITIALIZE_CALLS: List[tuple] = []


def _record_mooncake_initialize() -> None:
    """Note what SGLang's engine wrapper passes to Mooncake's ``initialize``.

    A pass-through observer: the real method runs with the same arguments and
    its return value is returned unchanged. It exists because the protocol is
    decided inside the release's wrapper (hard-coded "rdma" up to 0.5.12,
    ``MOONCAKE_PROTOCOL`` later), and the harness reports what the engine was
    really started with, not what it asked for.
    """
    from mooncake.engine import TransferEngine

    if getattr(TransferEngine, "_harness_recorded", False):
        return
    original = TransferEngine.initialize

    def initialize(self, *args, **kwargs):
        _MOONCAKE_INITIALIZE_CALLS.append(tuple(args) + tuple(kwargs.values()))
        return original(self, *args, **kwargs)

    TransferEngine.initialize = initialize
    TransferEngine._harness_recorded = True


def init_shared_engines(server_args, gpu_id: int = 0, protocol: str = "tcp") -> List[str]:
    """Start what ``ModelRunner`` starts for PD transfer (the shared Mooncake engine).

    Same condition as the release's model runner: the backend string equals
    ``"mooncake"`` after ``ServerArgs.__post_init__``. ``protocol`` is what
    the operator asked for; with ``rdma`` a failing engine start is reported
    as an RDMA start failure naming the IB device tried.
    """
    from .transport import rdma_init_failure

    started = []
    if server_args.disaggregation_mode != "null" and server_args.disaggregation_transfer_backend == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )
        from sglang.srt.utils.network import get_local_ip_auto

        _record_mooncake_initialize()
        ib_device = server_args.disaggregation_ib_device
        if not ib_device and releases.features().server_args_mooncake_ib_device:
            ib_device = server_args.mooncake_ib_device
        try:
            init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=gpu_id, ib_device=ib_device)
        except Exception as exc:
            if protocol != "rdma":
                raise
            raise RuntimeError(
                rdma_init_failure("Mooncake TransferEngine", ib_device, f"{type(exc).__name__}: {exc}")
            ) from exc
        started.append("mooncake-transfer-engine")
    return started


def mooncake_engine_report(server_args, protocol: str) -> Optional[Dict[str, Any]]:
    """What the shared Mooncake engine was started with and the transport it installed.

    ``None`` when this process has no shared engine. With ``protocol`` "rdma"
    and no RDMA device, Mooncake falls back to TCP and reports success; this
    raises "RDMA init failed" instead, so a TCP run is never reported as RDMA.
    """
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine,
    )

    from .transport import mooncake_hcas, mooncake_transport, rdma_init_failure

    wrapper = get_mooncake_transfer_engine()
    if wrapper is None:
        return None
    call = _MOONCAKE_INITIALIZE_CALLS[-1] if _MOONCAKE_INITIALIZE_CALLS else ()
    protocol_arg = call[2] if len(call) > 2 else None
    device_arg = call[3] if len(call) > 3 else None
    force_tcp = os.environ.get("MC_FORCE_TCP") == "1"
    topology, hcas = "", None
    if protocol_arg == "rdma" and not force_tcp:  # only then do HCAs decide the transport
        topology = wrapper.engine.get_local_topology(device_arg or "")
        hcas = mooncake_hcas(topology)
    report = {
        "engine": "mooncake",
        "initialize_protocol": protocol_arg,
        "initialize_device_name": device_arg,
        "mc_force_tcp": force_tcp,
        "hcas": hcas,
        "transport": mooncake_transport(protocol_arg, force_tcp, hcas),
    }
    if protocol == "rdma" and report["transport"] != "rdma":
        why = (
            "MC_FORCE_TCP=1 is set" if force_tcp
            else f"initialize() got protocol {protocol_arg!r}" if protocol_arg != "rdma"
            else "no RDMA device found (local topology "
            + " ".join(topology.split())
            + "); Mooncake installed its TCP transport instead and this run stops rather than report TCP as RDMA"
        )
        raise RuntimeError(rdma_init_failure("Mooncake TransferEngine", server_args.disaggregation_ib_device, why))
    return report


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# -- pools --------------------------------------------------------------------------


def make_mha_pool(
    num_pages: int, page_size: int, dtype, head_num: int, head_dim: int, layer_num: int, device: str = "cpu"
):
    """A real ``MHATokenToKVPool`` on ``device`` with pages ``0 .. num_pages-1``.

    The pool allocates ``size + page_size`` token slots; ``size`` is chosen so
    the buffers hold exactly ``num_pages`` pages.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if num_pages < 2:
        raise ValueError("an MHA pool needs num_pages >= 2 (page 0 is SGLang's padding page)")
    return MHATokenToKVPool(
        size=(num_pages - 1) * page_size,
        page_size=page_size,
        dtype=dtype,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
        start_layer=0,
    )


def mha_pool_tensors(pool) -> list:
    """The pool's buffers in ``get_contiguous_buf_infos`` order (K layers, V layers)."""
    return list(pool.k_buffer) + list(pool.v_buffer)


def make_metadata_buffers(rows: int, hidden_size: int, dtype, kv_checksum: bool = False):
    """``kv_checksum``: build them as ``--disaggregation-enable-kv-checksum`` does (0.5.21+:
    one more buffer, the last); a release without that buffer refuses it by name."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    kwargs = {}
    if releases.features().metadata_buffers_sampling_mask:  # 0.5.2x
        kwargs["max_sampling_mask_tokens"] = 0
    if kv_checksum:
        if not releases.features().metadata_buffers_kv_checksum:
            raise RuntimeError(
                f"SGLang {sglang_version()}'s MetadataBuffers has no KV-checksum buffer (no kv_checksum_enabled "
                "parameter): the scenario's kv_checksum_on cannot be built on this release"
            )
        kwargs["kv_checksum_enabled"] = True
    return MetadataBuffers(rows, hidden_size, dtype, **kwargs)


def metadata_tensors(meta, ptrs: Sequence[int]) -> list:
    """Map ``get_buf_infos`` pointers back to the MetadataBuffers tensors."""
    import torch

    by_ptr = {}
    for value in vars(meta).values():
        if isinstance(value, torch.Tensor):
            by_ptr.setdefault(value.data_ptr(), value)
    missing = [p for p in ptrs if p not in by_ptr]
    if missing:
        raise RuntimeError(f"metadata buffer pointers without a tensor: {missing}")
    return [by_ptr[p] for p in ptrs]


# -- KVArgs --------------------------------------------------------------------------


@dataclasses.dataclass
class StateComponent:
    """One state component's buffers as the transfer backend sees them."""

    kind: str
    ptrs: List[int]
    lens: List[int]
    item_lens: List[int]
    # Paged kinds: the MHA pool's ``kv_cache_layout`` ("nhd" ...), None where
    # the release's pool has none (``pool_kv_cache_layout``).
    kv_cache_layout: Optional[str] = None


def pool_kv_cache_layout(pool) -> Optional[str]:
    """The page layout of a harness MHA pool, as ``setup_state_kv_args`` reads it.

    0.5.23 ``disaggregation/utils.py:1554`` copies ``swa_kv_pool.kv_cache_layout``
    into ``KVArgs.swa_kv_cache_layout``, and heterogeneous-TP SWA transfers
    refuse anything but "nhd" (``common/conn.py:1771``). Releases whose pools
    have no such attribute give None.
    """
    return getattr(pool, "kv_cache_layout", None)


# Per-component releases: the StateType member each scenario kind maps to, in
# order of preference. 0.5.13+ renamed NSA to DSA (``StateType.DSA``); no
# release has a DSv4 member and 0.5.12 registers the DeepSeek-V4 pool as a SWA
# component (``setup_state_kv_args``).
_STATE_TYPE_CANDIDATES = {"nsa": ("nsa", "dsa"), "dsv4": ("dsv4", "swa")}


def state_type_for(kind: str):
    """The value a release's KVArgs carries for a state kind.

    Flat releases carry the string itself (``"dsv4"`` included: stock flat
    ``maybe_send_extra`` has no branch for it). Per-component releases carry a
    ``StateType`` member (see ``_STATE_TYPE_CANDIDATES``).
    """
    if is_flat():
        return kind
    from sglang.srt.disaggregation.base.conn import StateType

    for value in _STATE_TYPE_CANDIDATES.get(kind, (kind,)):
        try:
            return StateType(value)
        except ValueError:
            continue
    raise ValueError(f"SGLang {sglang_version()} has no StateType for state kind {kind!r}")


def _kv_args_fields(kv_args) -> frozenset:
    return releases.declared_fields(type(kv_args))


def fill_kv_args(
    kv_args,
    role: str,
    server_args,
    kv_pool,
    meta,
    components: Sequence[StateComponent],
    num_layers: int,
    total_kv_heads: int,
    engine_rank: int = 0,
    gpu_id: int = 0,
) -> Dict[str, Any]:
    """Fill ``kv_args`` the way the release's prefill/decode ``_init_kv_manager`` does.

    Fields a release does not declare on ``KVArgs`` are not set. Per-component
    releases get their defaults from the release's own ``setup_state_kv_args``
    (the KV pool has no state of its own, so it registers none), then each
    scenario component is added with the release's ``append_state_component``.
    Returns a short description of what was registered (for the result).
    """
    from sglang.srt.disaggregation import utils as dutils

    fields = _kv_args_fields(kv_args)
    feats = releases.features()
    kv_args.engine_rank = engine_rank  # the TP rank, as prefill.py/decode.py set it
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    if "kv_cache_dtype_str" in fields:  # 0.5.2x
        kv_args.kv_cache_dtype_str = server_args.kv_cache_dtype
    if "kv_layout" in fields:
        kv_args.kv_layout = dutils.get_pd_kv_layout(kv_pool) if feats.pd_kv_layout else None
    if "rust_http_port" in fields and role == "prefill":
        kv_args.rust_http_port = None
    if role == "prefill":
        kv_args.prefill_start_layer = kv_pool.start_layer
        if "mla_compression_ratios" in fields:
            kv_args.mla_compression_ratios = None
    if feats.kv_transfer_buf_infos:
        ptrs, lens, items = dutils.get_kv_transfer_buf_infos(kv_pool)
    else:
        ptrs, lens, items = kv_pool.get_contiguous_buf_infos()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
    if role == "prefill" and "prefill_end_layer" in fields:
        kv_args.prefill_end_layer = getattr(kv_pool, "end_layer", None)
    if "num_draft_entries" in fields:
        kv_args.num_draft_entries = 0
    if "kv_layer_ids" in fields and feats.build_kv_layer_ids:
        kv_args.kv_layer_ids = dutils.build_kv_layer_ids(
            token_to_kv_pool=kv_pool, draft_token_to_kv_pool=None, num_draft_entries=0, num_hidden_layers=num_layers
        )
    elif "kv_layer_ids" in fields:
        # No build_kv_layer_ids (0.5.18): prefill.py/decode.py set the pool's
        # get_kv_layer_ids() where it has one (hybrid linear pools only), else [].
        kv_args.kv_layer_ids = list(getattr(kv_pool, "get_kv_layer_ids", lambda: [])())
    if role == "prefill":  # non-MLA prefill only, as in prefill.py
        kv_args.kv_head_num = kv_pool.head_num
        kv_args.total_kv_head_num = total_kv_heads
    kv_args.page_size = kv_pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = server_args.disaggregation_ib_device
    kv_args.gpu_id = gpu_id

    if is_flat():
        if len(components) > 1:
            raise ValueError(
                f"SGLang {sglang_version()} has the flat state layout (one state component); "
                f"the scenario has {len(components)}"
            )
        if components:
            c = components[0]
            kv_args.state_data_ptrs = list(c.ptrs)
            kv_args.state_data_lens = list(c.lens)
            kv_args.state_item_lens = list(c.item_lens)
            kv_args.state_type = state_type_for(c.kind)
        else:
            kv_args.state_data_ptrs = []
            kv_args.state_data_lens = []
            kv_args.state_item_lens = []
            kv_args.state_type = "none"
        registered = [str(kv_args.state_type)]
    else:
        dutils.setup_state_kv_args(kv_args, kv_pool, None, num_layers, req_to_token_pool=None)
        if kv_args.state_types:
            raise RuntimeError(f"the plain KV pool registered state components: {kv_args.state_types}")
        for c in components:
            dutils.append_state_component(
                kv_args, state_type_for(c.kind), list(c.ptrs), list(c.lens), list(c.item_lens)
            )
            # What setup_state_kv_args records for an SWAKVPool whose window
            # cache is an MHA pool (0.5.23 utils.py:1554); the harness appends
            # the component itself, so it records the layout too.
            if c.kind == "swa" and c.kv_cache_layout is not None and "swa_kv_cache_layout" in fields:
                kv_args.swa_kv_cache_layout = c.kv_cache_layout
        registered = [getattr(t, "value", str(t)) for t in kv_args.state_types]
    return {"state_layout": state_layout().value, "state_types": registered}


def state_payload(kinds: Sequence[str], lists: Sequence[Optional[Sequence[int]]]):
    """``state_indices`` for ``send`` / ``send_metadata`` in the release's layout.

    Paged kinds pass an int32 page array (what ``kv_to_page_indices`` returns),
    Mamba a one-element list, as the schedulers do. Flat: the single
    component's value (``None`` without state). Per-component: one entry per
    component, ``None`` where a side passes nothing.
    """

    def one(kind, pages):
        if pages is None:
            return None
        if kind == "mamba":
            return [int(p) for p in pages]
        return np.asarray(list(pages), dtype=np.int32)

    if is_flat():
        if not kinds:
            return None
        return one(kinds[0], lists[0])
    return [one(k, p) for k, p in zip(kinds, lists)]


# -- manager, sender, receiver ---------------------------------------------------------------


def kv_classes(server_args) -> Dict[str, Any]:
    """The backend's classes, obtained exactly as the schedulers obtain them."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    out = {"backend": backend}
    for name in ("KVARGS", "MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER"):
        out[name.lower()] = get_kv_class(backend, getattr(KVClassType, name))
    return out


def disaggregation_mode(role: str):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE


def make_manager(manager_class, kv_args, role: str, server_args):
    return manager_class(kv_args, disaggregation_mode(role), server_args, False)


def sglang_ranks(mgr) -> Dict[str, Optional[int]]:
    """The ranks SGLang computed in this process, not the ones the harness asked for.

    ``attn_tp_rank``/``attn_tp_size``: what the manager read from SGLang's
    parallel state when it was built (``CommonKVManager.__init__``: the
    ``get_attention_tp_*`` getters up to 0.5.12, ``get_parallel()`` on 0.5.23);
    the bootstrap server and the head slices use these. ``world_rank`` /
    ``world_size``: the gloo world this process joined.
    """
    import torch.distributed as dist

    ready = dist.is_initialized()
    return {
        "attn_tp_rank": getattr(mgr, "attn_tp_rank", None),
        "attn_tp_size": getattr(mgr, "attn_tp_size", None),
        "world_rank": dist.get_rank() if ready else None,
        "world_size": dist.get_world_size() if ready else None,
    }


def make_sender(sender_class, mgr, bootstrap_addr: str, room: int):
    params = releases.init_parameters(sender_class)
    kwargs = dict(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room)
    if "dest_tp_ranks" in params:  # up to 0.5.12
        kwargs["dest_tp_ranks"] = [0]
    if "pp_rank" in params:
        kwargs["pp_rank"] = 0
    return sender_class(**kwargs)


def make_receiver(receiver_class, mgr, bootstrap_addr: str, room: int):
    return receiver_class(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room)


def try_ensure_prefill_info(mgr, bootstrap_addr: str) -> bool:
    """One non-blocking attempt, as the decode scheduler's pending queue makes."""
    return bool(mgr.try_ensure_parallel_info(bootstrap_addr))


def kvpoll():
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll


def poll_name(value) -> str:
    KVPoll = kvpoll()
    for name in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"):
        if value == getattr(KVPoll, name):
            return name
    return f"unknown({value!r})"


def failure_reason(mgr, room: int) -> Optional[str]:
    records = getattr(mgr, "failure_records", None)
    if not records:
        return None
    value = records.get(room)
    return None if value is None else str(value)


def class_name(obj_or_cls) -> str:
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"
