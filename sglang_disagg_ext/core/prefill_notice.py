"""Telling a prefill that decode refused its requests (F14, F19): which prefills can be told, whom, what.

Pure: no SGLang, no zmq. When decode refuses a prefill before any receiver of it is initialised
(F14: it cannot pair; F19: it runs a newer SGLang), stock never tells that prefill: its half of each
request waits in Bootstrapping until its bootstrap timeout (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``,
300 s by default), and SGLang's router answers the client only then, once per try (about 25 minutes
for a router's six tries). Prefill's bootstrap thread takes an ``ABORT`` message for a room (frames
``[b"ABORT", room]``, 0.5.22+ ``common/conn.py`` ``AbortNotification``; Mooncake, NIXL and MoRI
handle it in their bootstrap loops) and ends that room Failed at once. A prefill on an older release
would read the same message as a registration and raise (Mooncake's bootstrap thread dies of it:
F8), so decode sends it only to a prefill whose bootstrap answer carries
``decode_allocation_policy``: the field came with the same release (0.5.22) and is always sent.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

ABORT_TAG = b"ABORT"
# In every bootstrap answer from 0.5.22 on, the first release whose prefills take ABORT.
TAKES_ABORT_FIELD = "decode_allocation_policy"
# Prefill ranks one notice may address (dp x cp x tp x pp); a larger answer is not believed.
MAX_RANKS = 1024
# Seconds after the refusal at which the notice is sent: SGLang's router sends a request to prefill
# and decode at once, so prefill may make its room after decode refused it; ABORT for a room
# prefill does not know yet is ignored there, so it is sent again.
SEND_AT_S = (0.0, 1.0, 3.0)


def takes_abort(answer: Mapping[str, object]) -> bool:
    """Whether the prefill that gave this bootstrap answer handles ABORT messages."""
    return TAKES_ABORT_FIELD in answer


def rank_queries(answer: Mapping[str, object]) -> List[Dict[str, int]]:
    """The ``/route`` queries naming each prefill rank of this answer (its dp, cp, attention TP and
    PP sizes), for its ``rank_ip`` and ``rank_port``; [] where a size is missing or not a positive int."""
    sizes = []
    for name in ("dp_size", "attn_cp_size", "attn_tp_size", "pp_size"):
        value = answer.get(name, 1 if name == "attn_cp_size" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return []
        sizes.append(value)
    dp, cp, tp, pp = sizes
    if dp * cp * tp * pp > MAX_RANKS:
        return []
    return [{"prefill_dp_rank": d, "prefill_cp_rank": c, "target_tp_rank": t, "target_pp_rank": p}
            for d in range(dp) for c in range(cp) for t in range(tp) for p in range(pp)]


def endpoint(rank_answer: Mapping[str, object]) -> str:
    """The ZMQ address of a prefill rank's bootstrap socket, from its ``/route`` answer."""
    ip, port = rank_answer["rank_ip"], int(rank_answer["rank_port"])
    host = f"[{ip}]" if ":" in str(ip) else str(ip)
    return f"tcp://{host}:{port}"


def abort_frames(room: int) -> Tuple[bytes, bytes]:
    """The ABORT message for one room, as 0.5.22+ decodes send it without a return address."""
    return ABORT_TAG, str(int(room)).encode("ascii")


def aborted_room(msg) -> Optional[int]:
    """The room of an ABORT message (``ABORT``, room, ...: every release's decode puts the room in
    frame 1, whatever follows), or None for any other message or a malformed one."""
    if not msg or msg[0] != ABORT_TAG:
        return None
    try:
        return int(msg[1].decode("ascii"))
    except (IndexError, AttributeError, UnicodeDecodeError, ValueError):
        return None

