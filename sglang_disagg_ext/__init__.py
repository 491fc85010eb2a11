"""sglang-disagg-ext: fixed prefill/decode state-transfer backends for SGLang.

Select ``--disaggregation-transfer-backend mooncake-ext`` (or ``nixl-ext``,
``mori-ext``); SGLang loads this package through its ``sglang.srt.plugins``
entry point. Layers, bottom up: ``core`` (pure logic, no SGLang import),
``backends`` (one thin adapter per transfer engine), ``registration`` (the
``-ext`` names), ``releases`` (every per-release difference).
"""

__version__ = "0.3.0"
