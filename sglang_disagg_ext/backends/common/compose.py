"""Fixes that live in every engine's manager, composed in one place.

``registration.activate`` hands each engine's routed classes (``ext_classes``) here; the manager
class gets the live engine-independent mixins in front of it (outermost first). An engine whose
``-ext`` name routes no manager of its own gets SGLang's manager with them.

* F20 (``prefill_lookup``, outermost): decode's lookup of a prefill's parallel info runs off its
  scheduler thread.
* F14 (``prefill_pairing``): decode refuses a prefill it cannot pair with instead of raising on
  its scheduler thread.
* F19 (``prefill_answer``, inside F14): decode refuses a prefill on a newer release by name instead
  of failing to read its bootstrap answer.
* F16 (``room_claims``): the sender and receiver classes (the engine's own routed ones, else
  SGLang's) refuse a second live request with a bootstrap room already in use.
"""

from __future__ import annotations

from typing import Dict

from sglang_disagg_ext.backend_table import Backend
from sglang_disagg_ext.releases import ReleasePolicy


def _mixins(policy: ReleasePolicy) -> tuple:
    mixins = []
    if policy.is_live("F20"):
        from sglang_disagg_ext import releases
        from sglang_disagg_ext.backends.common.prefill_lookup import PrefillLookupOffThreadMixin

        if releases.stock_prefill_info_lookup() is not None:
            mixins.append(("F20", PrefillLookupOffThreadMixin))
    if policy.is_live("F14"):
        from sglang_disagg_ext.backends.common.prefill_pairing import PrefillPairingMixin

        mixins.append(("F14", PrefillPairingMixin))
    if policy.is_live("F19"):
        from sglang_disagg_ext import releases
        from sglang_disagg_ext.backends.common.prefill_answer import NewerPrefillAnswerMixin

        if releases.stock_prefill_info_lookup() is not None:
            mixins.append(("F19", NewerPrefillAnswerMixin))
    return tuple(mixins)


def compose(classes: Dict[str, type], package, backend: Backend, policy: ReleasePolicy) -> Dict[str, type]:
    """``classes`` (attribute -> class to route) with ``backend``'s manager, sender and receiver
    wrapped by the live engine-independent fixes."""
    if policy.is_live("F16"):
        from sglang_disagg_ext.backends.common.room_claims import with_room_claims

        classes = dict(classes)
        for attr, side in ((backend.sender_class, "prefill"), (backend.receiver_class, "decode")):
            classes[attr] = with_room_claims(classes.get(attr) or getattr(package, attr), side)
    manager_attr = backend.manager_class
    mixins = _mixins(policy)
    if not mixins:
        return classes
    base = classes.get(manager_attr) or getattr(package, manager_attr)
    fixes = "".join(fix for fix, _ in mixins)
    # Over one of the plugin's own managers the composed class keeps that class's module and name:
    # the activation line, doctor and the tests name the engine's adapter (which fixes it carries
    # is in the activation line). Over SGLang's own manager it must not pass for stock: it is
    # named here, with its fixes.
    ours = base.__module__.startswith("sglang_disagg_ext.")
    composed = type(
        base.__name__ if ours else f"{base.__name__}_{fixes}",
        tuple(m for _, m in mixins) + (base,),
        {"__module__": base.__module__ if ours else __name__,
         "__qualname__": base.__qualname__ if ours else f"{base.__name__}_{fixes}",
         "__doc__": f"{base.__doc__} With {', '.join(m.__name__ for _, m in mixins)}."},
    )
    return {**classes, manager_attr: composed}
