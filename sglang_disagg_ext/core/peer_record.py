"""The compatibility record an ``-ext`` decode publishes at registration, and prefill's verdict on it (F18).

Pure: no SGLang, no torch.

Stock Mooncake addresses a decode KV page as ``dst_ptr + index * item_len`` with
*prefill's* ``item_len`` (bytes of one page of one layer buffer), in every release
0.5.10.post1-0.5.23 (``_send_kvcache_generic``). Nothing compares it with decode's
when both sides run the same attention TP: a decode serving another model
configuration (another head dim, KV dtype or page size: a rolling upgrade half
done, a config pushed to one pool only) is written at the wrong offsets. With
larger decode pages, every write lands inside decode's pool but in pages no
request targeted, and both sides report Success; with smaller ones the writes
run past decode's buffers and the engine rejects them (stock then fails the whole
session with a generic reason).

The ``-ext`` decode puts one record (:func:`record`) in the pool-bounds frame its
registration already carries (``core.index_bounds``); the ``-ext`` prefill
compares it with its own (:func:`incompatibilities`) once per registration and
refuses the decode session when any field that decides where bytes land
differs, naming every such field and both values. The release and plugin
version are carried for the refusal line and for one INFO line when a
compatible pair runs different ones (a rolling upgrade): they are not refused
on their own, the layout decides.

What is compared, and why only that:

* ``wire``: the record's own format. A peer with another one is refused (a
  future format may mean other frames).
* ``page_size`` (tokens per page), where both published it.
* KV bytes per page of each layer buffer (``kv_item_lens``), where both sides
  run the same attention TP size (stock then copies whole pages with prefill's
  size). Refused when some size of prefill's is not among decode's: decode may
  hold more buffers of other sizes (a draft model's layers appended), never
  fewer kinds. Across TP sizes the page holds another head share, and stock's
  head-slicing path reads decode's size itself; there the bytes per head per
  page (``item_len // kv_head_num``: page size x head dim x dtype size) are
  compared where both sides know their head count (SGLang sets it on prefill,
  and on decode only for staging), else nothing.
* The KV dtype name is carried but not compared: ``auto`` and the model's
  dtype name the same bytes, and a different size already shows in the bytes
  per head.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

# This record's format. Another value on a peer: refused (see the module docstring).
WIRE = 1


def record(*, plugin: str, sglang: str, page_size, kv_item_lens: Sequence[int], kv_head_num=None,
           attn_tp_size=None, kv_dtype=None, page_for_page: bool = True) -> Dict[str, object]:
    """The record of one side, as JSON-ready values. ``kv_head_num``: KV heads this rank holds
    (SGLang's ``KVArgs.kv_head_num``); values that are not positive ints are left out.
    ``page_for_page`` False: this side's KV moves in another layout than whole pages of equal
    size (HiSparse's per-token host pages, decode context parallel's re-layout), where page
    sizes and bytes per page legitimately differ: the layout fields are left out, so nothing
    is compared."""
    rec: Dict[str, object] = {"wire": WIRE, "plugin": str(plugin), "sglang": str(sglang)}
    if not page_for_page:
        rec["page_for_page"] = False
        return rec
    if _count(page_size):
        rec["page_size"] = int(page_size)
    if _count(attn_tp_size):
        rec["attn_tp_size"] = int(attn_tp_size)
    if _count(kv_head_num):
        rec["kv_head_num"] = int(kv_head_num)
    lens = [int(v) for v in kv_item_lens or () if _count(v)]
    if lens:
        rec["kv_item_lens"] = sorted(set(lens))
    if isinstance(kv_dtype, str) and kv_dtype:
        rec["kv_dtype"] = kv_dtype
    return rec


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def bytes_per_head(rec: Dict[str, object]) -> Optional[List[int]]:
    """Distinct KV bytes per head per page of one side, or None when the record cannot say
    (no head count, no item lengths, or an item length the head count does not divide)."""
    heads, lens = rec.get("kv_head_num"), rec.get("kv_item_lens")
    if not _count(heads) or not isinstance(lens, list) or not lens:
        return None
    if any(not _count(v) or v % heads for v in lens):
        return None
    return sorted({v // heads for v in lens})


def incompatibilities(prefill: Dict[str, object], decode: Dict[str, object]) -> List[str]:
    """Every compared field that differs, as "<field>: prefill <value>, decode <value>"; empty: compatible.

    Fields one side did not publish are not compared (see the module docstring)."""
    out: List[str] = []
    if decode.get("wire") != prefill.get("wire"):
        out.append(f"handshake format: prefill {prefill.get('wire')}, decode {decode.get('wire')}")
        return out  # nothing else in a record of another format can be read the same way
    p_page, d_page = prefill.get("page_size"), decode.get("page_size")
    if _count(p_page) and _count(d_page) and p_page != d_page:
        out.append(f"page size (tokens): prefill {p_page}, decode {d_page}")
    p_tp, d_tp = prefill.get("attn_tp_size"), decode.get("attn_tp_size")
    p_lens, d_lens = prefill.get("kv_item_lens"), decode.get("kv_item_lens")
    if _count(p_tp) and p_tp == d_tp and isinstance(p_lens, list) and isinstance(d_lens, list):
        if p_lens and d_lens and not set(p_lens) <= set(d_lens):
            out.append(f"KV bytes per page of a layer buffer (attention TP {p_tp} on both sides): "
                       f"prefill {p_lens}, decode {d_lens}")
        return out
    p_head, d_head = bytes_per_head(prefill), bytes_per_head(decode)
    if p_head is not None and d_head is not None and not set(p_head) <= set(d_head):
        out.append(
            f"KV bytes per head per page (page size x head dim x dtype size): prefill {p_head}, decode {d_head}"
        )
    return out


def identity(rec: Dict[str, object]) -> str:
    """"SGLang <release>, sglang-disagg-ext <version>" of one side."""
    return f"SGLang {rec.get('sglang', '?')}, sglang-disagg-ext {rec.get('plugin', '?')}"


def refusal(session: str, prefill: Dict[str, object], decode: Dict[str, object],
            differences: Sequence[str]) -> str:
    """The reason every request to a refused decode session carries (both sides log it)."""
    return (
        f"decode session {session} cannot be served: its KV cache layout differs from this prefill's "
        f"({'; '.join(differences)}): the two servers run different model configurations; decode runs "
        f"{identity(decode)}, this prefill {identity(prefill)}"
    )


def parse(value) -> Optional[Dict[str, object]]:
    """A record read from a peer's frame, or None when it is not one (a dict with an int ``wire``)."""
    if isinstance(value, dict) and isinstance(value.get("wire"), int) and not isinstance(value.get("wire"), bool):
        return dict(value)
    return None
