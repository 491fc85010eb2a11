"""Import-only stand-in for torchvision on CPU test machines.

Why: SGLang imports torchvision at module level (``utils/common.py``,
``multimodal/internvl_utils.py``) but the transfer and memory-pool code this
project tests never calls it. The only torchvision wheel matching torch 2.13 is
a CUDA build that fails to load on CPU (``operator torchvision::nms does not
exist``). This stand-in is installed into the *test* virtual environments only
(``scripts/setup_venv.sh``); it is never shipped with the plugin.

Every ``torchvision.*`` submodule is importable and every attribute exists, but
calling anything raises, so an accidental real use fails loudly instead of
returning made-up data.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+sglang-disagg-ext-cpu-stub"


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} is an import-only CPU stand-in (no torchvision on this machine)"
        )

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")

    def __mro_entries__(self, bases):
        # Allow `class X(torchvision.something.Base)` at import time.
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self.__name__}.{item}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())


def __getattr__(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _Unavailable(f"torchvision.{item}")
