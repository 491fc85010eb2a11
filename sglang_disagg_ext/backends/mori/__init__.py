"""``mori-ext``: F3's classes on 0.5.12.x, F12's on every other release, picked in ``conn.ext_classes``.

``conn`` F3 (per-component state) · ``metadata_order`` F12 (rows ahead of their room's status) ·
``aux_rows`` (F12's row checks, in both) · ``transfer_info`` (a transfer message that raises fails
its room) · ``verify`` (verified transfers, MoRI's half).
"""
