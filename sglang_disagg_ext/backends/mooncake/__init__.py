"""``mooncake-ext``: SGLang's ``MooncakeKVManager`` with one mixin per fix, composed in ``conn.ext_classes``.

``conn`` (the classes routed, F1/F2's state-index plan) · ``isolation`` F6 · ``state_pairing`` F7 ·
``threads`` F8 · ``registration`` F9 · ``peers`` (the pool-sizes frame F6 and F9 read) · ``verify``
(verified transfers, Mooncake's half). Imported only by ``registration`` (through ``backend_table``).
"""
