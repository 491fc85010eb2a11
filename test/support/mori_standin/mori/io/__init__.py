"""``mori.io`` of the stand-in: same layout as MoRI's (engine wrapper + re-exports)."""

from .engine import *  # noqa: F401,F403
from mori.cpp import (  # noqa: F401
    BackendType,
    EngineDesc,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    set_log_level,
)
