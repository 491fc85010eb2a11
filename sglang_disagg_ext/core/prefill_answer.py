"""A prefill's bootstrap answer with fields this decode's release does not know (F19).

Pure: no SGLang, no torch. Decode asks each prefill once for its parallel info (``GET /route``
with every rank -1) and builds SGLang's ``PrefillServerInfo(**answer)`` from the JSON. Each
release adds fields to that answer (0.5.16 ``enable_dsa_cache_layer_split`` and
``prefill_http_port``, 0.5.22 ``decode_allocation_policy``, 0.5.23 ``enable_kv_cache_sharding``;
``dsv41_spec_layout`` and ``kv_layout`` only when set), always sent; an older decode's class does
not take them, so its build raises ``TypeError``, and stock asks again each second until 15 tries
end the waiting requests with "Could not fetch prefill parallel info".

Reading the answer anyway does not make the pair work: a decode older than its prefill does not
speak the newer prefill's messages (0.5.11 decode with 0.5.23 prefill, both ``-ext``: prefill
cannot parse decode's registration, decode cannot unpack prefill's status messages; docs/fixes.md,
F19). So a field this decode does not know marks a prefill it must refuse, at once, naming the
fields; the operator's fix is to upgrade decode before prefill (a newer decode reads an older
prefill's answer: every field it added has a default).
"""

from __future__ import annotations

from typing import Collection, Dict, Mapping


def unknown_fields(answer: Mapping[str, object], known_fields: Collection[str]) -> Dict[str, object]:
    """The answer's fields (with their values) that this decode's ``PrefillServerInfo`` lacks."""
    return {name: value for name, value in answer.items() if name not in known_fields}


def refusal_reason(bootstrap_addr: str, decode_release: str, unknown: Mapping[str, object]) -> str:
    """Why this decode refuses the prefill at ``bootstrap_addr``, naming each field it does not know."""
    fields = ", ".join(f"{name}={value!r}" for name, value in sorted(unknown.items()))
    return (f"prefill {bootstrap_addr} runs a newer SGLang than this decode (SGLang {decode_release}): its "
            f"bootstrap answer has fields this decode does not know ({fields}), and a decode older than its "
            f"prefill cannot read its messages; upgrade decode before prefill")
