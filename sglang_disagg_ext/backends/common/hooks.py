"""The fixes that are hooks, not ``-ext`` classes: functions put into SGLang's own modules and classes.

One table, read by ``registration`` as it reads ``backend_table`` for the classes: a hook is
installed where its fix is live on the installed release, whichever ``-ext`` name is activated,
and ``registration.deactivate`` takes every one out again. Each hook's module has an idempotent
``install`` returning what it hooked, an ``uninstall`` that puts back exactly what was there, an
``installed()`` and a context manager built on :func:`toggled` (tests run stock and ``-ext``
side by side in one process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from typing import Callable, Tuple

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Hook:
    fix: str
    module: str  # the plugin module with install / uninstall
    install: str
    uninstall: str
    what: str  # the activation line's words for it
    # True: an ImportError from install means the SGLang module the hook goes into cannot be
    # imported in this process (F10 up to 0.5.12.x: the decode module, with its scheduler imports);
    # the -ext classes still route and the activation line names the hook as missing. False: raise.
    optional: bool = False


HOOKS: Tuple[Hook, ...] = (
    Hook("F5", "sglang_disagg_ext.backends.common.retract", "install_retract_fixes", "uninstall_retract_fixes",
         "retract/resume"),
    Hook("F10", "sglang_disagg_ext.backends.common.metadata_gate", "install_metadata_gate_deadline",
         "uninstall_metadata_gate_deadline", "metadata gate deadline", optional=True),
    Hook("F21", "sglang_disagg_ext.backends.common.held_pages", "install_held_pages", "uninstall_held_pages",
         "held pages past the release timeout", optional=True),
)


def install(hook: Hook) -> str:
    """Install ``hook``; the activation line's words for the outcome."""
    try:
        getattr(importlib.import_module(hook.module), hook.install)()
    except ImportError as exc:
        if not hook.optional:
            raise
        logger.warning("sglang-disagg-ext %s not installed: %s", hook.fix, exc)
        return f"no {hook.what} ({hook.fix}: {exc})"
    return f"{hook.what} ({hook.fix})"


def uninstall_all() -> None:
    for hook in HOOKS:
        getattr(importlib.import_module(hook.module), hook.uninstall)()


@contextlib.contextmanager
def toggled(enabled: bool, installed: Callable[[], bool], install_fn: Callable, uninstall_fn: Callable):
    """Run a block with a hook installed (``enabled``) or with stock code, then restore what was."""
    was_installed = installed()
    if enabled:
        install_fn()
    else:
        uninstall_fn()
    try:
        yield
    finally:
        if was_installed:
            install_fn()
        else:
            uninstall_fn()
