"""Import-only stand-ins for GPU packages on CPU test machines.

Installed next to SGLang into the *test* virtual environments only
(``scripts/setup_venv.sh``), never shipped with the plugin. A package that
uses it (``torchvision/__init__.py``, ``sgl_kernel/__init__.py``) calls
``stand_in(__name__, why)``: then every submodule of that package is
importable and every attribute exists, but calling anything raises, so an
accidental real use fails loudly instead of returning made-up data.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["stand_in"]

VERSION = "0.0.0+sglang-disagg-ext-cpu-stub"


class _Unavailable:
    def __init__(self, name, why):
        self._name = name
        self._why = why

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is an import-only CPU stand-in ({self._why})")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}", self._why)

    def __mro_entries__(self, bases):
        # Allow `class X(package.something.Base)` at import time.
        return (object,)


class _StubModule(types.ModuleType):
    _stub_why = ""

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self.__name__}.{item}", self._stub_why)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package, why):
        self._prefix = package + "."
        self._why = why

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(self._prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module._stub_why = self._why
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def stand_in(package, why):
    """Turn the already-imported top-level `package` into an import-only stand-in."""
    module = sys.modules[package]
    module.__class__ = _StubModule
    module._stub_why = why
    module.__version__ = VERSION
    sys.meta_path.append(_StubFinder(package, why))
