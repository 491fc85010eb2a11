"""What every engine's ``-ext`` classes share.

``compose`` (engine-independent mixins over each engine's manager: F14 ``prefill_pairing``) ·
``hooks`` (the table of fixes that are hooks into SGLang's own code: F5 ``retract``, F10
``metadata_gate``) · ``verify`` (verified transfers, the engine-independent half) over
``digest_kernels`` · ``transfer_count`` (every request counted and timed) · ``shared``.
No module here imports an engine package.
"""
