"""``nixl-ext``: one manager class per release range, picked in ``conn.ext_classes``.

``conn`` F4 (0.5.10.post1-0.5.12.x: head slices, per-rank notification keys, memory kinds) ·
``swa_tp`` F13 (0.5.13-0.5.21) · ``head_sliced`` F11 (0.5.22-0.5.23) · ``transfer_deadline`` F22 (0.5.20-0.5.23, over F13's or F11's) · ``registration`` (the
refusal F11 and F13 share) · ``verify`` (verified transfers, NIXL's half).
"""
