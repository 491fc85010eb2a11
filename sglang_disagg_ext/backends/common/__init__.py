"""What every engine's ``-ext`` classes share.

``compose`` (engine-independent mixins over each engine's manager: F14 ``prefill_pairing``) ·
``retract`` F5 · ``metadata_gate`` F10 · ``verify`` (verified transfers, the engine-independent
half) over ``digest_kernels`` · ``transfer_count`` (every request counted and timed) · ``shared``.
No module here imports an engine package.
"""
