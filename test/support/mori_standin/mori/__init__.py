"""Test stand-in for AMD's MoRI package (``mori``): NOT the real MoRI.

The boundary
    SGLang 0.5.12.post1 ``sglang/srt/disaggregation/mori/conn.py`` imports exactly
    ``from mori.cpp import TransferStatus`` and ``from mori.io import BackendType,
    EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType,
    PollCqMode, RdmaBackendConfig``. This package provides those names (and the
    few more the 0.5.23 conn.py uses: ``StatusCode``, ``TransferStatus.Wait``,
    ``IOEngine.deregister_memory`` / ``wait_all``) and nothing above them:
    bootstrap, registration, wire format and per-component dispatch stay
    SGLang's and the plugin's real code.

What it does
    ``IOEngine.batch_write`` really copies bytes from this process's registered
    buffers into the registered buffers of the *remote* engine's process, using
    Linux cross-memory attach (``process_vm_writev`` on the pid carried in the
    remote ``EngineDesc``), on an executor thread, and reports one
    ``TransferStatus`` per transfer the way MoRI does (IN_PROGRESS when posted,
    then SUCCESS, or an error code with a message: unregistered memory or
    remote engine, out-of-bounds offsets, a failed copy).

What it is not
    No RDMA, no GPU, no QP handshake: every registered buffer is host memory of
    the process that registered it (the harness's CPU pools). It lives under
    ``test/support`` and is importable only where a test or the harness puts
    ``test/support/mori_standin`` on ``PYTHONPATH``; it is never installed with
    the plugin, so ``sglang-disagg-ext doctor`` keeps reporting ``mori`` as not
    importable in a normal environment.
"""

STANDIN = True
STANDIN_BOUNDARY = (
    "MoRI IO engine replaced at mori.io / mori.cpp by an in-repo stand-in "
    "(test/support/mori_standin) that copies bytes between the prefill and decode "
    "processes' registered CPU buffers with process_vm_writev; everything above it "
    "is SGLang's and the plugin's real code"
)
