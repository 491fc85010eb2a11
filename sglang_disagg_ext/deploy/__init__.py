"""Deployment helpers: start 1P1D (prefill, decode, router), stop it, run GSM8K against it.

``commands`` is pure (argument vectors, validation; no SGLang import, no
processes); ``gsm8k`` builds the evaluation command and parses its output. ``procs`` owns every process this
package starts. ``launch_pd`` and ``gsm8k`` are the command lines
(``sglang-disagg-ext launch-pd`` and ``gsm8k``; ``scripts/launch_pd.py`` and ``scripts/gsm8k.py`` run them from a checkout). ``mini_lb`` is the in-tree PD
load balancer used where ``sglang_router`` is not installed.
"""


class DeployError(RuntimeError):
    """A problem the operator can fix; the message says what and where."""
