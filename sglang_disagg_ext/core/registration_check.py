"""Whether a prefill can serve a decode peer's metadata (aux) buffers (F9). Pure: no SGLang, no torch.

SGLang's Mooncake ``send_aux`` pairs prefill's and decode's metadata buffers
by position and addresses both with prefill's row size
(``ptr + item_len * index``). That is only right when both sides registered
the same buffers: an optional buffer enabled on one engine only (the KV
checksum, the sampling mask, the DSA top-k seed) changes the count, and a
buffer sized differently (speculative decoding's hidden-state buffer on one
side only, a different sampling-mask width) changes the row size. Either way
the metadata decode reads is not the metadata prefill wrote. 0.5.23 logs the
count difference and sends the shorter list anyway; older releases index
prefill's lists with decode's positions.

The verdict is reached once per decode registration. Decode's buffer count is
in every registration (stock frame 5, packed pointers); its row sizes only
where an ``-ext`` decode published them (``core.index_bounds`` frame).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

COUNT_HINT = (
    "an optional metadata buffer is enabled on one side only (--disaggregation-enable-kv-checksum, "
    "SGLANG_ENABLE_DISAGG_SAMPLING_MASK or the DSA top-k buffer): enable it on both sides or on neither"
)
SIZE_HINT = (
    "the engines size a metadata buffer differently (e.g. speculative decoding's hidden-state buffer on "
    "one side only, or a different sampling-mask width): configure both sides alike"
)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sizes(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(v)) for v in values) + "]"


def aux_pairing_problem(
    prefill_item_lens: Sequence[int],
    decode_count: int,
    decode_item_lens: Optional[Sequence[int]] = None,
) -> Optional[str]:
    """Why prefill cannot send its metadata rows into this decode's buffers, or None.

    ``prefill_item_lens``: bytes per row of each prefill metadata buffer, in
    registration order; ``decode_count``: how many buffers decode registered;
    ``decode_item_lens``: decode's row sizes where it published them (None:
    not published, a stock decode). Sizes whose count disagrees with
    ``decode_count`` say nothing reliable and are not used.
    """
    prefill: List[int] = [int(v) for v in prefill_item_lens]
    decode = None if decode_item_lens is None else [int(v) for v in decode_item_lens]
    if decode is not None and len(decode) != decode_count:
        decode = None
    if decode_count != len(prefill):
        head = f"metadata buffers cannot be paired: prefill has {len(prefill)}, decode {decode_count}"
        if decode is None:
            return f"{head} (decode's row sizes unknown); {COUNT_HINT}"
        p = _common_prefix(prefill, decode)
        return (
            f"{head}; bytes per row from buffer {p} on: prefill {_sizes(prefill[p:])}, "
            f"decode {_sizes(decode[p:])}; {COUNT_HINT}"
        )
    if decode is None or decode == prefill:
        return None
    p = _common_prefix(prefill, decode)
    return (
        f"metadata buffers cannot be paired: {len(prefill)} on each side, but bytes per row differ "
        f"from buffer {p} on: prefill {_sizes(prefill[p:])}, decode {_sizes(decode[p:])}; {SIZE_HINT}"
    )

