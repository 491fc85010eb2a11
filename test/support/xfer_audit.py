"""Test-only prefill hook: record every remote (decode-side) descriptor the NIXL agent is asked to write.

``SGLANG_HARNESS_PREFILL_HOOK=<this file>:record_remote_descs`` with
``SGLANG_HARNESS_XFER_AUDIT=<file>``: the harness worker calls the hook in the
prefill process right after the manager exists (``worker._run_prefill_hook``).
It wraps the ``nixl_agent`` object itself (stock holds it as ``mgr.agent``,
``nixl-ext`` behind a proxy as ``mgr.agent._agent``), so every post either
manager builds passes through it, whichever of its own send paths built the
lists. Each call appends one JSON line to the file, *before* NIXL sees the lists
(a call NIXL then refuses is still recorded):

* ``{"op": "initialize_xfer", "peer": ..., "tag": ..., "remote": [[addr, len], ...]}``
  for ``initialize_xfer`` (every KV, state and aux write on 0.5.10.post1-0.5.12.x);
* ``{"op": "prep_xfer_dlist", "peer": ..., "remote": [...]}`` for a list prepared
  against a remote agent (not used on those releases without verified transfers;
  recorded so that a path that starts using it is not missed silently);
* once per peer, ``{"op": "peer", "peer": ..., "dst_kv_ptrs": [...], "dst_kv_item_len": n,
  "dst_aux_ptrs": [...], "dst_state_ptrs": [...], ...}``: what decode registered, as
  prefill parsed decode's registration message (``KVArgsRegisterInfo`` in
  ``decode_kv_args_table``), with prefill's own aux and state row sizes.

The addresses are read back from NIXL's own descriptor list (``nixlXferDList[i]``
is ``(addr, len, dev_id)``), i.e. what NIXL would be asked to write, not what
the manager meant to build. Nothing is decided here: the test derives decode's
pool ranges and judges the descriptors. It lives here, outside the wheel.
"""

import json
import os
import threading

AUDIT_ENV = "SGLANG_HARNESS_XFER_AUDIT"


def _rows(descs):
    """``[[addr, len], ...]`` of a NIXL descriptor list, an (N x >=2) array or a list of tuples."""
    if hasattr(descs, "descCount"):
        return [[int(descs[i][0]), int(descs[i][1])] for i in range(descs.descCount())]
    return [[int(row[0]), int(row[1])] for row in descs]


def _flat(xs) -> list:
    """Ints of a list that may nest one level per state component (0.5.12.x)."""
    out = []
    for x in xs or []:
        out.extend(_flat(x) if isinstance(x, (list, tuple)) else [int(x)])
    return out


def _text(tag) -> str:
    if isinstance(tag, (bytes, bytearray)):
        return bytes(tag).decode("ascii", "replace")
    return str(tag or "")


def record_remote_descs(mgr) -> None:
    path = os.environ[AUDIT_ENV]
    agent = mgr.agent
    raw = getattr(agent, "_agent", None) or agent  # nixl-ext's proxy holds the nixl_agent as _agent
    lock, peers_seen = threading.Lock(), set()
    initialize, prep = raw.initialize_xfer, raw.prep_xfer_dlist

    def write(line: dict) -> None:
        with lock, open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def note_peer(peer: str) -> None:
        if peer in peers_seen:
            return
        info = mgr.decode_kv_args_table.get(peer)
        if info is None:
            return
        peers_seen.add(peer)
        write({"op": "peer", "peer": peer, "dst_kv_ptrs": _flat(info.dst_kv_ptrs),
               "dst_kv_item_len": int(info.dst_kv_item_len), "dst_aux_ptrs": _flat(info.dst_aux_ptrs),
               "dst_state_ptrs": _flat(getattr(info, "dst_state_data_ptrs", [])),
               # Prefill's own row sizes: decode's registration names no aux or state
               # sizes on every release, and the harness builds the same pools both sides.
               "aux_item_lens": _flat(mgr.kv_args.aux_item_lens),
               "state_item_lens": _flat(getattr(mgr.kv_args, "state_item_lens", []) or [])})

    def initialize_xfer(operation, local_descs, remote_descs, remote_agent, notif_msg=b"", *args, **kwargs):
        note_peer(remote_agent)
        write({"op": "initialize_xfer", "peer": remote_agent, "tag": _text(notif_msg), "remote": _rows(remote_descs)})
        return initialize(operation, local_descs, remote_descs, remote_agent, notif_msg, *args, **kwargs)

    def prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs):
        if agent_name:  # "" (NIXL_INIT_AGENT): a local list
            note_peer(agent_name)
            write({"op": "prep_xfer_dlist", "peer": agent_name, "tag": "", "remote": _rows(xfer_list)})
        return prep(agent_name, xfer_list, *args, **kwargs)

    raw.initialize_xfer = initialize_xfer
    raw.prep_xfer_dlist = prep_xfer_dlist
