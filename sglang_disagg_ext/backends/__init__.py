"""One package per transfer engine, as SGLang keeps one folder per engine under ``disaggregation/``.

Each engine package's ``conn.py`` holds its ``-ext`` classes and ``ext_classes(policy)``: the
classes ``registration`` routes the ``-ext`` name to on the installed release (``backend_table``
names that module). The other modules of a package are one fix subject each, named by it; an
engine package never imports another engine's package (``test/unit/test_layout.py``). What every
engine shares lives in ``common/``. No module here is imported by ``core/``; the self-test rig is
never imported from here.

* ``mooncake/``: F1, F2 (``conn``), F6 (``isolation``), F7 (``state_pairing``), F8 (``threads``),
  F9 (``registration``), the pool-sizes frame F6 and F9 read (``peers``), verified transfers (``verify``).
* ``nixl/``: F4 (``conn``, 0.5.10.post1-0.5.12.x), F13 (``swa_tp``, 0.5.13-0.5.21), F11
  (``head_sliced``, 0.5.22-0.5.23), the registration refusal F11 and F13 share (``registration``),
  verified transfers (``verify``).
* ``mori/``: F3 (``conn``, 0.5.12.x), F12 (``metadata_order``; its row checks ``aux_rows``), a
  transfer message that raises on prefill (``transfer_info``), verified transfers (``verify``).
* ``common/``: F14 (``prefill_pairing``, composed over every engine's manager by ``compose``), the hooks
  table (``hooks``: F5 ``retract``, F10 ``metadata_gate``), the engine-independent half of verified transfers
  (``verify``, over ``digest_kernels``), the per-request transfer count (``transfer_count``) and
  small shared pieces (``shared``).
"""
