"""Teaches SGLang the ``-ext`` transfer-backend names. The plugin's entry point.

How an ``-ext`` name works, end to end:

1. ``load_plugin()`` (SGLang's ``sglang.srt.plugins`` entry point, or our
   launcher on releases without a plugin framework) adds ``mooncake-ext``,
   ``nixl-ext`` and ``mori-ext`` to the ``--disaggregation-transfer-backend``
   choices and wraps the ``ServerArgs`` method that resolves arguments
   (``__post_init__``, or ``resolve_once`` on releases that have it).
2. When server arguments name an ``-ext`` backend, the wrapper rewrites the
   value to its base name (``mooncake`` ...) *before* SGLang's own checks run,
   exactly as SGLang 0.5.13+ rewrites its ``mooncake_tcp`` alias. Every place
   SGLang compares the backend string or ``TransferBackend`` enum (staging
   buffer, IB device, shared Mooncake engine start, ...) therefore takes the
   base name's branch. The choice is recorded in ``SGLANG_DISAGG_EXT_BACKEND``
   (with the choosing process's PID in ``SGLANG_DISAGG_EXT_BACKEND_PID``) so
   every process SGLang starts afterwards inherits it; a value not set by an
   ancestor is stale and ignored.
3. In each process where an ``-ext`` backend is selected, ``activate()`` puts the
   plugin's classes into the SGLang backend package
   (``sglang.srt.disaggregation.mooncake`` ...). ``get_kv_class`` imports its
   classes from that package on every call, so every module that bound
   ``get_kv_class`` or ``TransferBackend`` by name sees the route without a
   list of importers to keep current.

On a release where a fix is already upstream, or on a pass-through release
(0.5.13 - 0.5.23), the classes stay SGLang's own; see ``releases.py``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Dict, Optional

from sglang_disagg_ext import activation_log, backend_table, releases

logger = logging.getLogger("sglang_disagg_ext")

# Inherited by every process SGLang spawns after argument parsing.
SELECTED_BACKEND_ENV = "SGLANG_DISAGG_EXT_BACKEND"
# The PID of the process whose server arguments chose that backend. A child
# honours the choice only when that process is itself or one of its ancestors:
# a value left over in an operator's shell (or copied from another server's
# environment) must never route a stock backend name to the plugin's classes.
SELECTED_BY_ENV = "SGLANG_DISAGG_EXT_BACKEND_PID"

# Base backend -> (SGLang package whose names get_kv_class imports,
#                  plugin module that defines ext_classes() for it): backend_table.
_BACKEND_MODULES = {b.name: (b.sglang_package, b.adapter_module) for b in backend_table.BACKENDS}

# (package name, attribute) -> the stock object we replaced, for deactivate().
_replaced: Dict[tuple, object] = {}
_active_backend: Optional[str] = None


def load_plugin() -> None:
    """Entry point of the ``sglang.srt.plugins`` group. Idempotent."""
    register_backend_names()
    _wrap_server_args_resolution()
    selected = inherited_selection()
    if selected:
        activate(selected)


def selection_env(ext_name: str, pid: Optional[int] = None) -> Dict[str, str]:
    """The environment that hands ``ext_name`` to the processes ``pid`` (default: this one) starts."""
    return {SELECTED_BACKEND_ENV: ext_name, SELECTED_BY_ENV: str(os.getpid() if pid is None else pid)}


def inherited_selection() -> Optional[str]:
    """The ``-ext`` backend this process inherited from the process that parsed the server
    arguments, or None. A selection not made by this process or an ancestor is stale: it is
    dropped from the environment (so nothing this process starts inherits it) with a warning."""
    selected = os.environ.get(SELECTED_BACKEND_ENV)
    if not selected:
        os.environ.pop(SELECTED_BY_ENV, None)
        return None
    owner = os.environ.get(SELECTED_BY_ENV, "")
    if owner.isdecimal() and _is_self_or_ancestor(int(owner)):
        return selected
    logger.warning(
        "ignoring %s=%s from the environment: it was not set by this process or one of its parents "
        "(%s=%r); the --disaggregation-transfer-backend argument decides",
        SELECTED_BACKEND_ENV, selected, SELECTED_BY_ENV, owner or None,
    )
    os.environ.pop(SELECTED_BACKEND_ENV, None)
    os.environ.pop(SELECTED_BY_ENV, None)
    return None


def _is_self_or_ancestor(pid: int) -> bool:
    import psutil

    if pid == os.getpid():
        return True
    try:
        return any(p.pid == pid for p in psutil.Process().parents())
    except psutil.Error:
        return False


def register_backend_names() -> None:
    from sglang.srt import server_args

    # add_disagg_transfer_backend_choices is list.extend in every release:
    # pass a list, and only the names not yet there (plugins may load twice).
    missing = [n for n in releases.EXT_BACKENDS if n not in server_args.DISAGG_TRANSFER_BACKEND_CHOICES]
    if missing:
        server_args.add_disagg_transfer_backend_choices(missing)


def _wrap_server_args_resolution() -> None:
    from sglang.srt.server_args import ServerArgs

    # __post_init__ up to 0.5.12, resolve_once() later (releases.SGLangFeatures).
    method = releases.features().server_args_resolution
    original = getattr(ServerArgs, method)
    if getattr(original, "_sglang_disagg_ext", False):
        return

    @functools.wraps(original)
    def resolve_then_original(self, *args, **kwargs):
        resolve_ext_backend(self)
        return original(self, *args, **kwargs)

    resolve_then_original._sglang_disagg_ext = True
    setattr(ServerArgs, method, resolve_then_original)


# The ServerArgs records resolve_ext_backend rewrote in this process (the last few).
_rewritten: list = []
_REWRITTEN_KEPT = 16


def resolve_ext_backend(server_args) -> Optional[str]:
    """Rewrite an ``-ext`` backend name to its base and activate the plugin.

    Returns the ``-ext`` name that was selected, or ``None``. Raises
    ``UnsupportedSGLangRelease`` (naming the supported range) when an ``-ext``
    name is asked for on a release the plugin does not support.
    """
    name = getattr(server_args, "disaggregation_transfer_backend", None)
    if any(record is server_args for record in _rewritten):
        # A record this process already rewrote ("mooncake-ext" -> "mooncake"),
        # resolved again: 0.5.23's resolve_once() is called more than once and
        # returns early the second time. Its base name is not a stock choice.
        return None
    if name not in releases.EXT_BACKENDS:
        if os.environ.get(SELECTED_BY_ENV) == str(os.getpid()):
            # This process chose an -ext backend for earlier arguments and now
            # parses a stock name: the stock name wins here and in its children.
            os.environ.pop(SELECTED_BACKEND_ENV, None)
            os.environ.pop(SELECTED_BY_ENV, None)
            if _active_backend is not None:
                deactivate()
        return None
    releases.current_policy().check_supported()
    server_args.disaggregation_transfer_backend = releases.EXT_BACKENDS[name]
    # Held (not weakly: a msgspec ServerArgs takes no weak reference) so a second
    # resolution of the same record is recognised; a process builds a few.
    _rewritten.append(server_args)
    del _rewritten[:-_REWRITTEN_KEPT]
    os.environ.update(selection_env(name))
    activate(name)
    return name


def activate(ext_name: str) -> None:
    """Route ``ext_name``'s base backend to the plugin's classes in this process."""
    global _active_backend
    if ext_name not in releases.EXT_BACKENDS:
        raise ValueError(
            f"{SELECTED_BACKEND_ENV}={ext_name!r} is not an -ext backend; "
            f"valid: {', '.join(releases.EXT_BACKENDS)}"
        )
    policy = releases.current_policy()
    policy.check_supported()
    if _active_backend == ext_name:
        return
    if not policy.known and not _warned_unknown:
        _warn_unknown_release(policy)
    from sglang_disagg_ext import verification

    if verification.invalid_setting():
        logger.error("sglang-disagg-ext: %s", verification.invalid_setting())
    if _active_backend is not None:
        deactivate()
    base = releases.EXT_BACKENDS[ext_name]
    routed = []
    if policy.support is releases.Support.ACTIVE:
        package_name, plugin_module = _BACKEND_MODULES[base]
        try:
            ext_classes = importlib.import_module(plugin_module).ext_classes(policy)
        except ImportError as exc:
            if not _missing_engine(exc, base):
                raise
            # The transfer engine itself is missing (e.g. MoRI off ROCm). Stock
            # SGLang parses such a name and fails when it builds the manager;
            # the -ext name behaves the same: same error, same place.
            logger.warning("%s: %s is not importable here (%s); %s routing not installed", ext_name, base, exc, ext_name)
            ext_classes = {}
        package = importlib.import_module(package_name) if ext_classes else None
        if ext_classes:
            from sglang_disagg_ext.backends.common import compose as common_fixes

            ext_classes = common_fixes.compose(ext_classes, package, backend_table.BY_NAME[base], policy)
        for attr, cls in ext_classes.items():
            key = (package_name, attr)
            _replaced.setdefault(key, getattr(package, attr))
            setattr(package, attr, cls)
            routed.append(attr)
        if ext_classes:
            _count_transfers(package, package_name, base, ext_name)
        from sglang_disagg_ext.backends.common import hooks

        routed += [hooks.install(hook) for hook in hooks.HOOKS if policy.is_live(hook.fix)]
    _active_backend = ext_name
    line = f"{policy.summary_line()}; {ext_name} -> " + (
        ", ".join(routed) if routed else f"stock {base} classes (pass-through)")
    # Lost in a scheduler process (logging is not configured yet); the -ext
    # manager logs it again once it exists (activation_log).
    activation_log.record(line, ext_name)
    logger.info(line)


def _count_transfers(package, package_name: str, base: str, ext_name: str) -> None:
    """Route the routed backend's sender and receiver (plugin's or stock) through a counting subclass."""
    from sglang_disagg_ext.backends.common.transfer_count import counted

    record = backend_table.BY_NAME[base]
    for attr, role in ((record.sender_class, "prefill"), (record.receiver_class, "decode")):
        cls = getattr(package, attr, None)
        if cls is None:
            continue
        _replaced.setdefault((package_name, attr), cls)
        setattr(package, attr, counted(cls, ext_name, role))


_warned_unknown = False


def _warn_unknown_release(policy: releases.ReleasePolicy) -> None:
    global _warned_unknown
    _warned_unknown = True
    logger.warning(policy.unknown_release_warning())


def _missing_engine(exc: BaseException, base: str) -> bool:
    """Whether an import failed because the transfer engine itself is absent."""
    engine_roots = backend_table.BY_NAME[base].engine_packages
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and name and name.split(".")[0] in engine_roots:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def deactivate() -> None:
    """Undo ``activate()`` in this process (tests run stock and ext side by side)."""
    global _active_backend
    for (package_name, attr), original in list(_replaced.items()):
        setattr(importlib.import_module(package_name), attr, original)
    _replaced.clear()
    from sglang_disagg_ext.backends.common import hooks

    hooks.uninstall_all()
    activation_log.record(None)
    _active_backend = None


def active_backend() -> Optional[str]:
    return _active_backend
