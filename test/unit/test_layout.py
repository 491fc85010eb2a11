"""The package's layout, read from its source with ``ast`` (no SGLang import).

* No import cycle among ``sglang_disagg_ext`` modules. Every import counts as an
  edge: module-level ones and those inside functions.
* No runtime module (everything outside ``sglang_disagg_ext/selftest/``) imports
  ``sglang_disagg_ext.selftest``; the console script's ``selftest`` subcommand
  (``cli._selftest``) is the one exception, a function-level import.
* ``releases.py`` is the one place that probes SGLang's code: no other module
  imports ``inspect`` or calls ``hasattr(``; the few ``hasattr`` calls in the
  self-test rig that look at plain Python or NIXL objects (not SGLang) are
  listed below, with what they look at.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sglang_disagg_ext"
NAME = "sglang_disagg_ext"

# (file, source of the hasattr call): probes of objects that are not SGLang's.
HASATTR_ALLOWED = {
    # duck-typing a tensor the rig compares (torch, not SGLang)
    ("selftest/harness/patterns.py", "hasattr(actual, 'detach')"),
    ("selftest/harness/patterns.py", "hasattr(actual, 'cpu')"),
    # NIXL's own binding (nixl_cu12), not SGLang
    ("selftest/harness/nixl_pacing.py", "hasattr(field, '__set__')"),
}

# The one way in from the runtime to the rig: the console script's ``selftest``
# subcommand, imported inside the function that runs it (never at module level).
RIG_ENTRY = {(f"{NAME}.cli", f"{NAME}.selftest.runner")}


def _modules():
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([NAME, *parts])] = (path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return out


MODULES = _modules()


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        package = package.rsplit(".", 1)[0]
    return f"{package}.{node.module}" if node.module else package


def _own(name: str):
    """The package module ``name`` refers to (a submodule, or its parent for ``from x import attr``)."""
    while name and name not in MODULES:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


def _imports(module: str, module_level_only: bool = False):
    """(target module, line) for every import of a package module in ``module``."""
    path, tree = MODULES[module]
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _own(alias.name)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            for alias in node.names:
                target = _own(f"{base}.{alias.name}") if base.startswith(NAME) else None
                if target:
                    yield target, node.lineno


def _graph():
    return {m: {t for t, _ in _imports(m) if t != m} for m in MODULES}


def _is_rig(module: str) -> bool:
    return module == f"{NAME}.selftest" or module.startswith(f"{NAME}.selftest.")


@pytest.mark.timeout(30)
def test_the_scan_sees_the_package():
    assert f"{NAME}.releases" in MODULES and f"{NAME}.backend_table" in MODULES
    graph = _graph()
    assert f"{NAME}.releases" in graph[f"{NAME}.registration"]
    assert f"{NAME}.backends.common.hooks" in graph[f"{NAME}.registration"]  # a function-level import


@pytest.mark.timeout(30)
def test_no_import_cycle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.timeout(30)
def test_runtime_never_imports_the_selftest_rig():
    bad = [
        f"{MODULES[m][0].relative_to(ROOT)}:{line} imports {t}"
        for m in MODULES
        if not _is_rig(m)
        for t, line in _imports(m)
        if _is_rig(t) and (m, t) not in RIG_ENTRY
    ]
    assert not bad, "\n".join(bad)
    for m, t in RIG_ENTRY:
        assert t not in {x for x, _ in _imports(m, module_level_only=True)}, f"{m} imports {t} at module level"
        assert t in {x for x, _ in _imports(m)}, f"{m} no longer imports {t}: drop it from RIG_ENTRY"


@pytest.mark.timeout(30)
def test_only_releases_probes_sglang_code():
    found, hasattr_calls = [], set()
    for module, (path, tree) in MODULES.items():
        if module == f"{NAME}.releases":
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "inspect" for a in node.names):
                found.append(f"{rel}:{node.lineno}: import inspect")
            elif isinstance(node, ast.ImportFrom) and node.module == "inspect":
                found.append(f"{rel}:{node.lineno}: from inspect import ...")
            elif isinstance(node, ast.Name) and node.id == "inspect":
                found.append(f"{rel}:{node.lineno}: inspect")
            elif isinstance(node, ast.Attribute) and node.attr in ("getsource", "getsourcelines", "getsourcefile"):
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
                key = (rel, ast.unparse(node))
                hasattr_calls.add(key)
                if key not in HASATTR_ALLOWED:
                    found.append(f"{rel}:{node.lineno}: {key[1]}")
    assert not found, "probe SGLang in releases.features(), not here:\n" + "\n".join(found)
    # The allowance stays exact: a listed call that is gone is removed from the list.
    assert HASATTR_ALLOWED <= hasattr_calls, HASATTR_ALLOWED - hasattr_calls


ENGINES = ("mooncake", "nixl", "mori")


@pytest.mark.timeout(30)
def test_engine_packages_stay_apart():
    """``backends/<engine>/`` imports no other engine's package, and ``backends/common/`` none at all:
    what two engines share lives in ``common``. Each engine's ``conn`` is the adapter module
    ``backend_table`` names."""
    from sglang_disagg_ext import backend_table

    engine_of = {}
    for m in MODULES:
        for e in ENGINES:
            if m == f"{NAME}.backends.{e}" or m.startswith(f"{NAME}.backends.{e}."):
                engine_of[m] = e
    assert set(engine_of.values()) == set(ENGINES), engine_of
    bad = []
    for m in MODULES:
        if not m.startswith(f"{NAME}.backends."):
            continue
        mine = engine_of.get(m)
        for t, line in _imports(m):
            other = engine_of.get(t)
            if other is not None and other != mine:
                bad.append(f"{MODULES[m][0].relative_to(ROOT)}:{line} imports {t}")
    assert not bad, "\n".join(bad)
    for e in ENGINES:
        assert backend_table.BY_NAME[e].adapter_module == f"{NAME}.backends.{e}.conn"
