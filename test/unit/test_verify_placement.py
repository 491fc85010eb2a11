"""Where prefill's verified-transfer digest places a write (``VerifiedTransferMixin._verify_add_blocks``).

No engine and no SGLang manager: a bare subclass of the mixin with host tensors as the
prefill pool and as decode's registered buffers (addresses only, as decode's registration
gives them). Expected digests come from ``core.digest.item_digest``, the plain-Python
reference checked by hand in test_digest.py, over the bytes the test wrote itself.

Decode's staging ring (``SGLANG_DISAGG_STAGING_BUFFER``; SGLang allocates it on CUDA/XPU
pools only, so no transfer here can stage): a block landing in it must leave the room
unverified, never placed as a page of the registered buffer just below it (decode would
then fail a correct room on a page past that buffer's end).
"""

import threading
import types

import pytest

torch = pytest.importorskip("torch")

from sglang_disagg_ext.backends.common.verify import VerifiedTransferMixin  # noqa: E402
from sglang_disagg_ext.core import digest as dg  # noqa: E402

ITEM = 64  # bytes per KV page
PAGES = 4
ROOM, SESSION = 7, "decode-0"


class _Manager(VerifiedTransferMixin):
    """The mixin's prefill half over plain tensors (SGLang's constructor never runs)."""

    def __init__(self, src, dst, staging_ptr=0):
        self._verify_on = True
        self._verify_tls = threading.local()
        self._verify_lock = threading.Lock()
        self._verify_session_room = {SESSION: ROOM}
        self._verify_partials = {}
        self._verify_src = None
        self._verify_dst = {}
        self.server_args = types.SimpleNamespace(device="cpu")
        self.kv_args = types.SimpleNamespace(
            kv_data_ptrs=[t.data_ptr() for t in src], kv_data_lens=[t.nbytes for t in src],
            kv_item_lens=[ITEM] * len(src), aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[],
            state_data_ptrs=[], state_data_lens=[], state_item_lens=[])
        self.decode_kv_args_table = {SESSION: types.SimpleNamespace(
            dst_kv_ptrs=[t.data_ptr() for t in dst], dst_aux_ptrs=[], dst_state_data_ptrs=[],
            dst_kv_item_len=0, dst_kv_item_lens=[], dst_state_item_lens=[], staging_base_ptr=staging_ptr,
            staging_total_size=ITEM * PAGES if staging_ptr else 0)}

    def partial(self):
        return self._verify_partials[(ROOM, SESSION)]


def _pools(n):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (PAGES, ITEM), dtype=torch.uint8, generator=gen) for _ in range(n)]


@pytest.mark.timeout(30)
def test_whole_pages_are_placed_at_their_destination_page():
    src, dst = _pools(2), _pools(2)
    mgr = _Manager(src, dst)
    # Prefill page 1 of buffer 0 -> decode page 3 of buffer 0; page 2 of buffer 1 -> page 0 of buffer 1.
    mgr._verify_add_blocks(SESSION, [(src[0].data_ptr() + 1 * ITEM, dst[0].data_ptr() + 3 * ITEM, ITEM),
                                     (src[1].data_ptr() + 2 * ITEM, dst[1].data_ptr() + 0 * ITEM, ITEM)])
    p = mgr.partial()
    assert p.unplaced is None
    assert p.digests == {
        (dg.KV_COMPONENT, 0): dg.item_digest(bytes(src[0][1].tolist()), dg.KV_COMPONENT, 0, 3),
        (dg.KV_COMPONENT, 1): dg.item_digest(bytes(src[1][2].tolist()), dg.KV_COMPONENT, 1, 0),
    }
    assert sorted(p.pages[dg.KV_COMPONENT]) == [0, 3]


@pytest.mark.timeout(30)
def test_a_block_into_decodes_staging_ring_leaves_the_room_unverified():
    src, dst = _pools(1), _pools(1)
    staging = torch.zeros(PAGES * ITEM, dtype=torch.uint8)
    mgr = _Manager(src, dst, staging_ptr=staging.data_ptr())
    mgr._verify_add_blocks(SESSION, [(src[0].data_ptr(), staging.data_ptr() + ITEM, 2 * ITEM)])
    p = mgr.partial()
    assert p.unplaced is not None and "staging buffer" in p.unplaced, p.unplaced
    assert p.digests == {}
    # ... and the room sends no digest for that decode (counted unverified there, never failed).
    assert p.unverifiable(ROOM, SESSION)


@pytest.mark.timeout(30)
def test_the_staging_ring_bounds_the_buffer_below_it():
    """A registered buffer's extent is not in decode's registration: it ends where the next
    registered start begins. Without the staging entry, a staged block just above a KV buffer
    would be read as that buffer's page PAGES + k."""
    src = _pools(1)
    block = torch.zeros(2 * PAGES * ITEM, dtype=torch.uint8)  # decode KV buffer, then its staging ring
    dst_ptr, staging_ptr = block.data_ptr(), block.data_ptr() + PAGES * ITEM
    mgr = _Manager(src, [], staging_ptr=staging_ptr)
    mgr.decode_kv_args_table[SESSION].dst_kv_ptrs = [dst_ptr]
    mgr._verify_add_blocks(SESSION, [(src[0].data_ptr(), staging_ptr + ITEM, ITEM)])
    assert "staging buffer" in (mgr.partial().unplaced or "")
    # Without the ring registered the same block is taken as page PAGES + 1 of the KV buffer.
    plain = _Manager(src, [])
    plain.decode_kv_args_table[SESSION].dst_kv_ptrs = [dst_ptr]
    plain._verify_add_blocks(SESSION, [(src[0].data_ptr(), staging_ptr + ITEM, ITEM)])
    assert plain.partial().unplaced is None and plain.partial().pages[dg.KV_COMPONENT] == {PAGES + 1}
