"""F4 head slicing and notification sender ids.

Every expected table below was written out by hand from SGLang's head
placement (rank r holds heads [r*H/TP, (r+1)*H/TP) when H >= TP, head
r // (TP/H) when H < TP) and stock bootstrap pairing (decode d <- prefill
d // (D/P) when D >= P, <- prefill [d*P/D, (d+1)*P/D) when D < P). None of it
is computed by calling the code under test.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_disagg_ext.core.head_slice import (
    ENGINE_RANK_LIMIT,
    HeadLayout,
    HeadLayoutError,
    HeadSlice,
    build_head_slice_descriptors,
    head_bytes_from_item_len,
    notification_sender_id,
    resolve_total_kv_heads,
)
from sglang_disagg_ext.core.nixl_notif import with_sender_id

HEAD_BYTES = 256  # head_dim 128 x bf16

T, F = True, False

# (P, D, H) -> prefill heads per rank, decode heads per rank, bytes of one
# prefill / decode token row, and per (prefill rank, decode rank) pair:
# (src head start, dst head start, heads, is sender, src byte, dst byte, length).
HEAD_MAP_TABLES = {
    (4, 1, 8): dict(
        prefill={0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]},
        decode={0: [0, 1, 2, 3, 4, 5, 6, 7]},
        row_bytes=(512, 2048),
        pairs={
            (0, 0): (0, 0, 2, T, 0, 0, 512),
            (1, 0): (0, 2, 2, T, 0, 512, 512),
            (2, 0): (0, 4, 2, T, 0, 1024, 512),
            (3, 0): (0, 6, 2, T, 0, 1536, 512),
        },
    ),
    (1, 4, 8): dict(
        prefill={0: [0, 1, 2, 3, 4, 5, 6, 7]},
        decode={0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]},
        row_bytes=(2048, 512),
        pairs={
            (0, 0): (0, 0, 2, T, 0, 0, 512),
            (0, 1): (2, 0, 2, T, 512, 0, 512),
            (0, 2): (4, 0, 2, T, 1024, 0, 512),
            (0, 3): (6, 0, 2, T, 1536, 0, 512),
        },
    ),
    (2, 4, 2): dict(
        prefill={0: [0], 1: [1]},
        decode={0: [0], 1: [0], 2: [1], 3: [1]},
        row_bytes=(256, 256),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (0, 1): (0, 0, 1, T, 0, 0, 256),
            (1, 2): (0, 0, 1, T, 0, 0, 256),
            (1, 3): (0, 0, 1, T, 0, 0, 256),
        },
    ),
    (4, 2, 2): dict(
        prefill={0: [0], 1: [0], 2: [1], 3: [1]},
        decode={0: [0], 1: [1]},
        row_bytes=(256, 256),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (1, 0): (0, 0, 1, F, 0, 0, 256),
            (2, 1): (0, 0, 1, T, 0, 0, 256),
            (3, 1): (0, 0, 1, F, 0, 0, 256),
        },
    ),
    (4, 1, 2): dict(
        prefill={0: [0], 1: [0], 2: [1], 3: [1]},
        decode={0: [0, 1]},
        row_bytes=(256, 512),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (1, 0): (0, 0, 1, F, 0, 0, 256),
            (2, 0): (0, 1, 1, T, 0, 256, 256),
            (3, 0): (0, 1, 1, F, 0, 256, 256),
        },
    ),
    (8, 2, 4): dict(
        prefill={0: [0], 1: [0], 2: [1], 3: [1], 4: [2], 5: [2], 6: [3], 7: [3]},
        decode={0: [0, 1], 1: [2, 3]},
        row_bytes=(256, 512),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (1, 0): (0, 0, 1, F, 0, 0, 256),
            (2, 0): (0, 1, 1, T, 0, 256, 256),
            (3, 0): (0, 1, 1, F, 0, 256, 256),
            (4, 1): (0, 0, 1, T, 0, 0, 256),
            (5, 1): (0, 0, 1, F, 0, 0, 256),
            (6, 1): (0, 1, 1, T, 0, 256, 256),
            (7, 1): (0, 1, 1, F, 0, 256, 256),
        },
    ),
    # Upstream #31968: stock 0.5.11 picks source head d % 2 here, so decode
    # rank 1 got head 1 although it holds head 0.
    (1, 4, 2): dict(
        prefill={0: [0, 1]},
        decode={0: [0], 1: [0], 2: [1], 3: [1]},
        row_bytes=(512, 256),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (0, 1): (0, 0, 1, T, 0, 0, 256),
            (0, 2): (1, 0, 1, T, 256, 0, 256),
            (0, 3): (1, 0, 1, T, 256, 0, 256),
        },
    ),
    (2, 2, 1): dict(
        prefill={0: [0], 1: [0]},
        decode={0: [0], 1: [0]},
        row_bytes=(256, 256),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (1, 1): (0, 0, 1, T, 0, 0, 256),
        },
    ),
    (2, 1, 1): dict(
        prefill={0: [0], 1: [0]},
        decode={0: [0]},
        row_bytes=(256, 256),
        pairs={
            (0, 0): (0, 0, 1, T, 0, 0, 256),
            (1, 0): (0, 0, 1, F, 0, 0, 256),
        },
    ),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pdh", sorted(HEAD_MAP_TABLES), ids=lambda t: "P%dD%dH%d" % t)
def test_head_map_table(pdh):
    want = HEAD_MAP_TABLES[pdh]
    layout = HeadLayout(*pdh)
    P, D, _ = pdh

    assert {p: list(layout.prefill_heads(p)) for p in range(P)} == want["prefill"]
    assert {d: list(layout.decode_heads(d)) for d in range(D)} == want["decode"]
    prefill_row = layout.prefill_heads_per_rank * HEAD_BYTES
    decode_row = layout.decode_heads_per_rank * HEAD_BYTES
    assert (prefill_row, decode_row) == want["row_bytes"]

    # The pairs each prefill rank serves, and each decode rank's view of them.
    pairs_from_prefill = {(p, d) for p in range(P) for d in layout.decode_ranks_for_prefill(p)}
    pairs_from_decode = {(p, d) for d in range(D) for p in layout.prefill_ranks_for_decode(d)}
    assert pairs_from_prefill == pairs_from_decode == set(want["pairs"])

    for (p, d), (src_h, dst_h, n, sender, src_b, dst_b, length) in want["pairs"].items():
        got = layout.head_slice(p, d)
        assert got == HeadSlice(src_h, dst_h, n, sender), (p, d)
        assert tuple(got.byte_range(HEAD_BYTES)) == (src_b, dst_b, length), (p, d)


@pytest.mark.timeout(10)
def test_descriptors_hand_example():
    # P4 D1 H8, prefill rank 1 (heads 2,3) -> decode rank 0 (heads 0..7).
    # head_bytes 4, page_size 2: prefill token row 8 B, page 16 B; decode
    # token row 32 B, page 64 B. Slice: src byte 0, dst byte 8, length 8.
    hs = HeadLayout(4, 1, 8).head_slice(1, 0)
    rows = build_head_slice_descriptors(
        [1000, 2000],  # layer 0 K, layer 0 V on prefill
        [50000, 60000],
        [3, 0],
        [5, 1],
        page_size=2,
        src_item_len=16,
        dst_item_len=64,
        head_slice=hs,
        head_bytes=4,
    )
    expected = [
        # layer 1000/50000: page 3 -> 5, tokens 0, 1; page 0 -> 1, tokens 0, 1
        [1048, 50328, 8],
        [1056, 50360, 8],
        [1000, 50072, 8],
        [1008, 50104, 8],
        [2048, 60328, 8],
        [2056, 60360, 8],
        [2000, 60072, 8],
        [2008, 60104, 8],
    ]
    assert rows.dtype == np.int64
    assert rows.tolist() == expected


@pytest.mark.timeout(10)
def test_descriptors_empty_and_errors():
    hs = HeadLayout(4, 1, 8).head_slice(1, 0)
    kw = dict(page_size=2, src_item_len=16, dst_item_len=64, head_slice=hs, head_bytes=4)
    assert build_head_slice_descriptors([1], [2], [], [], **kw).shape == (0, 3)
    with pytest.raises(HeadLayoutError, match="3 prefill page indices vs 2"):
        build_head_slice_descriptors([1], [2], [1, 2, 3], [1, 2], **kw)
    with pytest.raises(HeadLayoutError, match="2 prefill layer buffers vs 1"):
        build_head_slice_descriptors([1, 2], [2], [1], [1], **kw)
    with pytest.raises(HeadLayoutError, match="negative page index"):
        build_head_slice_descriptors([1], [2], [-1], [1], **kw)
    # The slice writes decode bytes [8, 16) of each token row: a 12 B row is too short.
    with pytest.raises(HeadLayoutError, match="exceed the decode token row of 12 bytes"):
        build_head_slice_descriptors([1], [2], [1], [1], **{**kw, "dst_item_len": 24})
    with pytest.raises(HeadLayoutError, match="exceed the prefill token row of 4 bytes"):
        build_head_slice_descriptors([1], [2], [1], [1], **{**kw, "src_item_len": 8})
    with pytest.raises(HeadLayoutError, match="not a multiple of page_size 2"):
        build_head_slice_descriptors([1], [2], [1], [1], **{**kw, "src_item_len": 17})


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "pdh,pattern",
    [
        ((4, 1, 6), r"prefill TP size 4 does not divide the 6 KV heads"),
        ((1, 4, 6), r"decode TP size 4 does not divide the 6 KV heads"),
        ((4, 1, 3), r"3 KV heads cannot be replicated evenly over prefill TP size 4"),
        ((2, 6, 4), r"4 KV heads cannot be replicated evenly over decode TP size 6"),
        ((2, 3, 6), r"prefill TP size 2 and decode TP size 3"),
        ((0, 1, 8), r"prefill TP size must be positive, got 0"),
        ((1, -2, 8), r"decode TP size must be positive, got -2"),
        ((1, 1, 0), r"total KV heads must be positive, got 0"),
        ((1, 1, -8), r"total KV heads must be positive, got -8"),
        ((True, 1, 1), r"prefill TP size must be an int"),
        ((1, 1, 2.0), r"total KV heads must be an int"),
    ],
)
def test_impossible_layouts(pdh, pattern):
    with pytest.raises(HeadLayoutError, match=pattern):
        HeadLayout(*pdh)


@pytest.mark.timeout(10)
def test_bad_rank_requests():
    layout = HeadLayout(4, 2, 2)
    with pytest.raises(HeadLayoutError, match="prefill rank 2 does not serve decode rank 0"):
        layout.head_slice(2, 0)
    with pytest.raises(HeadLayoutError, match="prefill rank 4 out of range for TP size 4"):
        layout.prefill_heads(4)
    with pytest.raises(HeadLayoutError, match="decode rank -1 out of range"):
        layout.decode_heads(-1)
    assert issubclass(HeadLayoutError, ValueError)


@pytest.mark.timeout(10)
def test_resolve_total_kv_heads_and_head_bytes():
    assert resolve_total_kv_heads(8, 1, 4) == 8
    assert resolve_total_kv_heads(0, 2, 4) == 8  # fallback: per-rank x prefill TP
    assert resolve_total_kv_heads(None, 2, 4) == 8
    assert resolve_total_kv_heads(-1, 3, 2) == 6
    with pytest.raises(HeadLayoutError, match="kv_head_num \\(per rank\\) must be positive, got 0"):
        resolve_total_kv_heads(0, 0, 4)
    with pytest.raises(HeadLayoutError, match="prefill TP size must be positive, got 0"):
        resolve_total_kv_heads(None, 2, 0)
    # 4 tokens x 2 heads x 128 dim x 2 bytes = 2048 B per page.
    assert head_bytes_from_item_len(2048, 4, 2) == 256
    with pytest.raises(HeadLayoutError, match="item_len 1000 is not a multiple of page_size 3"):
        head_bytes_from_item_len(1000, 3, 2)


# --- property: every decode head written exactly once, from a holder -----------


def _is_valid_layout(P, D, H):
    """The placement rules, restated independently of the module."""

    def fits(tp):
        return H % tp == 0 if H >= tp else tp % H == 0

    return P > 0 and D > 0 and H > 0 and fits(P) and fits(D) and max(P, D) % min(P, D) == 0


VALID_LAYOUTS = [
    (P, D, H)
    for P in range(1, 17)
    for D in range(1, 17)
    for H in range(1, 33)
    if _is_valid_layout(P, D, H)
]


def _pattern(global_head, slot, layer, byte):
    return (global_head * 31 + slot * 7 + layer * 13 + byte) % 251 + 1


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(
    pdh=st.sampled_from(VALID_LAYOUTS),
    page_size=st.integers(1, 3),
    head_bytes=st.sampled_from([1, 2, 4]),
    num_layers=st.integers(1, 2),
    data=st.data(),
)
def test_every_decode_head_written_once_from_a_holder(pdh, page_size, head_bytes, num_layers, data):
    P, D, H = pdh
    layout = HeadLayout(P, D, H)
    pages = 4
    n_req = data.draw(st.integers(0, pages), label="pages in request")
    src_pages = np.array(data.draw(st.permutations(range(pages)))[:n_req], dtype=np.int64)
    dst_pages = np.array(data.draw(st.permutations(range(pages)))[:n_req], dtype=np.int64)

    src_row = layout.prefill_heads_per_rank * head_bytes
    dst_row = layout.decode_heads_per_rank * head_bytes
    src_item, dst_item = src_row * page_size, dst_row * page_size
    src_layer_bytes, dst_layer_bytes = src_item * pages, dst_item * pages

    # One flat "address space": all prefill buffers, then all decode buffers.
    prefill_base = [p * num_layers * src_layer_bytes for p in range(P)]
    decode_start = P * num_layers * src_layer_bytes
    decode_base = [decode_start + d * num_layers * dst_layer_bytes for d in range(D)]
    memory = np.zeros(decode_start + D * num_layers * dst_layer_bytes, dtype=np.int64)
    writes = np.zeros_like(memory)

    for p in range(P):
        for layer in range(num_layers):
            for slot in range(pages * page_size):
                for j, g in enumerate(layout.prefill_heads(p)):
                    for b in range(head_bytes):
                        addr = prefill_base[p] + layer * src_layer_bytes + slot * src_row + j * head_bytes + b
                        memory[addr] = _pattern(g, slot, layer, b)

    for p in range(P):
        for d in layout.decode_ranks_for_prefill(p):
            hs = layout.head_slice(p, d)
            for i in range(hs.num_heads):  # a sender reads only heads it holds
                assert hs.src_head_start + i < layout.prefill_heads_per_rank
                g_src = layout.prefill_heads(p)[hs.src_head_start + i]
                g_dst = layout.decode_heads(d)[hs.dst_head_start + i]
                assert g_src == g_dst
            if not hs.is_sender:
                continue
            rows = build_head_slice_descriptors(
                [prefill_base[p] + layer * src_layer_bytes for layer in range(num_layers)],
                [decode_base[d] + layer * dst_layer_bytes for layer in range(num_layers)],
                src_pages,
                dst_pages,
                page_size=page_size,
                src_item_len=src_item,
                dst_item_len=dst_item,
                head_slice=hs,
                head_bytes=head_bytes,
            )
            assert rows.shape == (num_layers * n_req * page_size, 3)
            for src, dst, length in rows.tolist():
                assert prefill_base[p] <= src and src + length <= prefill_base[p] + num_layers * src_layer_bytes
                assert decode_base[d] <= dst and dst + length <= decode_base[d] + num_layers * dst_layer_bytes
                memory[dst : dst + length] = memory[src : src + length]
                writes[dst : dst + length] += 1

    for d in range(D):
        for layer in range(num_layers):
            for k in range(n_req):
                for t in range(page_size):
                    src_slot = src_pages[k] * page_size + t
                    dst_slot = dst_pages[k] * page_size + t
                    row = decode_base[d] + layer * dst_layer_bytes + dst_slot * dst_row
                    assert (writes[row : row + dst_row] == 1).all(), (pdh, d, layer, k, t)
                    for j, g in enumerate(layout.decode_heads(d)):
                        for b in range(head_bytes):
                            assert memory[row + j * head_bytes + b] == _pattern(g, src_slot, layer, b)
    # Nothing outside the requested decode rows was touched.
    assert writes[decode_start:].sum() == D * num_layers * n_req * page_size * dst_row


@pytest.mark.timeout(60)
@settings(max_examples=500, deadline=None)
@given(P=st.integers(-1, 17), D=st.integers(-1, 17), H=st.integers(-1, 40))
def test_validation_matches_placement_rules(P, D, H):
    if _is_valid_layout(P, D, H):
        HeadLayout(P, D, H)
    else:
        with pytest.raises(HeadLayoutError):
            HeadLayout(P, D, H)


# --- notification sender ids (tags themselves: test_nixl_notif.py) ----------------


@pytest.mark.timeout(10)
def test_notification_sender_id():
    assert ENGINE_RANK_LIMIT == 65536
    assert notification_sender_id(0, 3) == 3
    assert notification_sender_id(1, 3) == 65539
    assert notification_sender_id(2, 0) == 131072
    with pytest.raises(ValueError, match="engine_rank 65536 >= 65536"):
        notification_sender_id(0, 65536)
    with pytest.raises(ValueError, match="pp_rank must be a non-negative int"):
        notification_sender_id(-1, 0)
    with pytest.raises(ValueError, match="engine_rank must be a non-negative int"):
        notification_sender_id(0, True)


def _stock_0_5_11_sender(key: str) -> int:
    # What stock 0.5.10.post1/0.5.11 decode does with a KV tag: split("_", 4)
    # and int() of field 4, used as the per-sender dict key.
    parts = key.split("_", 4)
    assert parts[1] == "kv"
    return int(parts[4])


def _stock_0_5_12_sender(key: str) -> int:
    parts = key.split("_", 8)
    assert parts[1] == "kv"
    return int(parts[4])


@pytest.mark.timeout(10)
def test_keys_unique_per_prefill_rank_as_stock_decode_reads_them():
    # Prefill PP 4 x TP 8 all reporting chunk 0 of room 42 to a decode with PP 1.
    # The stock 0.5.11 tag of that chunk carries pp_rank (0) as its sender field.
    keys = [with_sender_id("42_kv_0_1_0", pp, tp) for pp in range(4) for tp in range(8)]
    assert len({_stock_0_5_11_sender(k) for k in keys}) == 32
    assert len({_stock_0_5_12_sender(k) for k in keys}) == 32
    # The stock PP=1 bug: four TP ranks, one pp_rank, one key. Ours: four.
    assert len({with_sender_id("42_kv_0_1_0", 0, tp) for tp in range(4)}) == 4


@pytest.mark.timeout(10)
def test_head_slice_rows_by_hand():
    """P=1 -> D=2, 2 KV heads, 2 tokens a page, 4 bytes a head: prefill pages are 16 bytes
    (2 heads x 2 tokens x 4), decode pages 8. Decode rank 1 holds head 1: prefill page 3's
    token t, head 1 (1000 + 3*16 + t*8 + 4) goes to decode page 1's token t (5000 + 8 + t*4)."""
    from sglang_disagg_ext.core.head_slice import HeadLayout, head_slice_rows, transfer_requests

    layout = HeadLayout(1, 2, 2)
    rows = head_slice_rows(layout, layout.head_slice(0, 1), "KV", [1000], [5000], [3], [1],
                           page_size=2, src_item_len=16, dst_item_len=8)
    assert rows.tolist() == [[1052, 5008, 4], [1060, 5012, 4]]
    # No decode page size registered: derived from the layout (1 head x 2 tokens x 4 bytes).
    same = head_slice_rows(layout, layout.head_slice(0, 1), "KV", [1000], [5000], [3], [1],
                           page_size=2, src_item_len=16, dst_item_len=None)
    assert same.tolist() == rows.tolist()
    src, dst = transfer_requests(rows, 7, 9)
    assert src.tolist() == [[1052, 4, 7], [1060, 4, 7]] and dst.tolist() == [[5008, 4, 9], [5012, 4, 9]]


@pytest.mark.timeout(10)
def test_head_slice_rows_refuses_different_head_bytes():
    """Decode pages of 12 bytes hold one 6-byte head per token; prefill's heads are 4 bytes."""
    from sglang_disagg_ext.core.head_slice import HeadLayout, HeadLayoutError, head_slice_rows

    layout = HeadLayout(1, 2, 2)
    with pytest.raises(HeadLayoutError, match=r"one SWA state \(component 0\) head is 4 bytes per token on prefill but 6 on decode"):
        head_slice_rows(layout, layout.head_slice(0, 0), "SWA state (component 0)", [1000], [5000], [3], [1],
                        page_size=2, src_item_len=16, dst_item_len=12)
