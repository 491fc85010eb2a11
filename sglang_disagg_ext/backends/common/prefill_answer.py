"""F19: a decode refuses, at once and by name, a prefill that runs a newer SGLang.

Stock decode builds ``PrefillServerInfo(**answer)`` from each prefill's bootstrap answer
(``CommonKVManager.try_ensure_parallel_info``). A newer prefill's answer has fields this release's
class does not take, so the build raises ``TypeError``; stock logs it, asks again each second and,
after 15 tries, ends the waiting requests with "Could not fetch prefill parallel info" -- and so
for every later request, 15 ERRORs each time, none saying why.

The ``-ext`` manager runs stock's own lookup with ``PrefillServerInfo`` bound to a reader
(:class:`_AnswerReader`). An answer with no field this decode lacks builds stock's class as
before (stock's checks and rank mapping follow). An answer with such fields
(``core.prefill_answer``) refuses the prefill: the reader raises past stock's catch-all, and the
refusal table F14 also uses (``prefill_pairing.PrefillRefusals``) ends every request waiting for
that prefill Failed at once with a reason naming each field and its value, one ERROR per prefill,
and answers later requests from memory. Reading such an answer would not make the pair work: a decode older
than its prefill does not speak its messages (``core.prefill_answer``).

Only this lookup runs with the other binding: SGLang's module and class are untouched. Composed
where ``releases.stock_prefill_info_lookup()`` finds the lookup, inside F14 where that is live, and
innermost over ``try_ensure_parallel_info`` (it calls stock's function itself).
"""

from __future__ import annotations

import types

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.common.prefill_pairing import PrefillRefusals
from sglang_disagg_ext.core.prefill_answer import refusal_reason, unknown_fields

FIX = "F19"


class _RefusedAnswer(BaseException):
    """Raised by the reader inside stock's lookup. A BaseException so that the lookup's own
    ``except Exception`` (log, return False, ask again next second) does not swallow it; the mixin
    catches it and refuses the prefill."""


class _AnswerReader:
    """Stands in for ``PrefillServerInfo`` during one lookup."""

    def __init__(self, info_class, bootstrap_addr: str):
        self.info_class = info_class
        self.bootstrap_addr = bootstrap_addr

    def __call__(self, **answer):
        unknown = unknown_fields(answer, releases.declared_fields(self.info_class))
        if unknown:
            raise _RefusedAnswer(refusal_reason(self.bootstrap_addr, releases.installed_sglang_version(), unknown))
        return self.info_class(**answer)


class NewerPrefillAnswerMixin(PrefillRefusals):
    """Decode side of F19; prefill is unchanged."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Stock's lookup, refusing a prefill whose answer has fields this release does not know.

        Contract: stock decode's scheduler thread calls it (``DecodePreallocQueue._ensure_prefill_info``,
        through F14's override where F14 is live) once a second per prefill address with requests
        waiting, before any receiver of that address is initialised; True when the address's info is
        in ``prefill_info_table``. A refusal returns False with the address's waiting rooms Failed
        (``PrefillRefusals``, the table F14 also uses); it makes the one HTTP query stock makes, no
        other, and raises only what stock's lookup raises.
        """
        if bootstrap_addr in self.prefill_info_table:
            return True
        if self._ext_answer_refused(bootstrap_addr):
            return False
        lookup, info_class = releases.stock_prefill_info_lookup()
        # Stock's function over a copy of its module's globals with ``PrefillServerInfo`` bound to
        # the reader, for this call only (about once a second while requests wait for the address).
        read_with = types.FunctionType(
            lookup.__code__, {**lookup.__globals__, "PrefillServerInfo": _AnswerReader(info_class, bootstrap_addr)},
            lookup.__name__, lookup.__defaults__, lookup.__closure__)
        try:
            return read_with(self, bootstrap_addr)
        except _RefusedAnswer as refused:
            self._ext_refuse_prefill(bootstrap_addr, str(refused), FIX, "prefill newer than this decode")
            return False
