"""The -ext names inside the installed SGLang: parsing, routing, and every backend-name check.

These run SGLang's real argument parser and ServerArgs post-processing on CPU
(a model directory holding only a config.json).
"""

import ast
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import sglang
from sglang_disagg_ext import releases

SGLANG_ROOT = pathlib.Path(sglang.__file__).parent

# Places that compare the backend *string*, counted by hand in each wheel
# (grep "disaggregation_transfer_backend" with ==, != or in). The scan below
# must find at least these; more means a new site, which the test also covers.
STRING_SITES_BY_RELEASE = {"0.5.10.post1": 6, "0.5.11": 7, "0.5.12.post1": 7, "0.5.23": 19}


def _parse(args):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(args)
    if hasattr(server_args, "resolve_once"):  # 0.5.23: launchers resolve after parsing
        server_args.resolve_once()
    return server_args


def _server_args(tiny_model_dir, backend, mode="prefill"):
    return _parse(
        [
            "--model-path", tiny_model_dir,
            "--skip-tokenizer-init",
            "--device", "cpu",
            "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", backend,
        ]
    )


@pytest.fixture
def loaded(clean_activation):
    clean_activation.load_plugin()
    return clean_activation


@pytest.mark.timeout(30)
def test_names_registered_once(loaded):
    from sglang.srt import server_args

    loaded.load_plugin()  # SGLang may load plugins more than once per process
    for name in ("mooncake-ext", "nixl-ext", "mori-ext"):
        assert server_args.DISAGG_TRANSFER_BACKEND_CHOICES.count(name) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_ext_name_parses_to_base_and_routes(loaded, tiny_model_dir, policy, mode):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    args = _server_args(tiny_model_dir, "mooncake-ext", mode)
    assert args.disaggregation_transfer_backend == "mooncake"
    assert os.environ[loaded.SELECTED_BACKEND_ENV] == "mooncake-ext"
    manager = get_kv_class(TransferBackend(args.disaggregation_transfer_backend), KVClassType.MANAGER)
    if policy.routes("mooncake"):
        assert manager.__module__ == "sglang_disagg_ext.backends.mooncake.conn"
    else:
        assert manager.__module__ == "sglang.srt.disaggregation.mooncake.conn"


def _importers_of_routing_names():
    """Modules of the installed SGLang that bind get_kv_class or TransferBackend by name."""
    found = {}
    for path in sorted(SGLANG_ROOT.rglob("*.py")):
        text = path.read_text(errors="replace")
        if "get_kv_class" not in text and "TransferBackend" not in text:
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "sglang.srt.disaggregation.utils":
                names = {a.name for a in node.names} & {"get_kv_class", "TransferBackend"}
                if names:
                    rel = path.relative_to(SGLANG_ROOT.parent).with_suffix("")
                    found.setdefault(".".join(rel.parts), set()).update(names)
    return found


def _get_kv_class_backend_imports():
    """Packages that the installed get_kv_class imports its classes from, at call time."""
    tree = ast.parse((SGLANG_ROOT / "srt" / "disaggregation" / "utils.py").read_text())
    bodies = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_kv_class"]
    implementation = bodies[-1]  # the earlier ones are @overload stubs
    return {
        node.module
        for node in ast.walk(implementation)
        if isinstance(node, ast.ImportFrom) and node.module
    }


@pytest.mark.timeout(240)
def test_every_importer_sees_the_route(loaded, tiny_model_dir, policy):
    """Scans the installed SGLang, so a new importer cannot be missed.

    prefill.py / decode.py may import GPU kernels at module level (0.5.10.post1's
    decode.py imports sgl_kernel, which a CPU machine has only as this project's
    import-only stand-in), so the proof does not import them: two steps checked
    on the installed sources: (1) every importer binds the very function object
    ``sglang.srt.disaggregation.utils.get_kv_class`` (a from-import, never
    redefined or reassigned in that module), and (2) that function imports its
    classes from the backend package on each call, where the plugin routes them.
    Then calling ``utils.get_kv_class`` here is calling it from every importer.
    """
    from sglang.srt.disaggregation import utils

    importers = _importers_of_routing_names()
    # These build managers in every release we support (read from the wheels).
    assert {
        "sglang.srt.disaggregation.prefill",
        "sglang.srt.disaggregation.decode",
        "sglang.srt.managers.disagg_service",
    } <= set(importers)
    for module_name in importers:
        path = SGLANG_ROOT.parent / (module_name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ("get_kv_class", "TransferBackend"):
                pytest.fail(f"{module_name} defines its own {node.name}")
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in ("get_kv_class", "TransferBackend"):
                        pytest.fail(f"{module_name} rebinds {target.id}")

    assert {
        "sglang.srt.disaggregation.mooncake",
        "sglang.srt.disaggregation.nixl",
        "sglang.srt.disaggregation.mori",
    } <= _get_kv_class_backend_imports()

    args = _server_args(tiny_model_dir, "mooncake-ext")
    backend = utils.TransferBackend(args.disaggregation_transfer_backend)
    manager = utils.get_kv_class(backend, utils.KVClassType.MANAGER)
    expected = (
        "sglang_disagg_ext.backends.mooncake.conn"
        if policy.routes("mooncake")
        else "sglang.srt.disaggregation.mooncake.conn"
    )
    assert manager.__module__ == expected
    # The bootstrap server stays SGLang's for mooncake. Sender and receiver are SGLang's too, with
    # F16's room claims in front where F16 is live (a class of backends.common.room_claims over
    # SGLang's). The receiver is the plugin's own where F6 is live without SGLang's registration
    # hook (0.5.10.post1-0.5.12.x): there it adds decode's pool sizes to the registration message
    # (F16 composed over it keeps its module).
    stock = "sglang.srt.disaggregation.mooncake.conn"
    claimed = "sglang_disagg_ext.backends.common.room_claims" if policy.is_live("F16") else stock
    assert utils.get_kv_class(backend, utils.KVClassType.BOOTSTRAP_SERVER).__module__ == stock
    sender = utils.get_kv_class(backend, utils.KVClassType.SENDER)
    assert sender.__module__ == claimed
    import sglang.srt.disaggregation.mooncake.conn as stock_conn

    assert issubclass(sender, stock_conn.MooncakeKVSender)
    receiver = utils.get_kv_class(backend, utils.KVClassType.RECEIVER)
    own_receiver = (policy.routes("mooncake") and (policy.is_live("F6") or policy.is_live("F9"))
                    and not releases.features().mooncake_registration_hooks)
    assert receiver.__module__ == ("sglang_disagg_ext.backends.mooncake.peers" if own_receiver else claimed)
    assert issubclass(receiver, stock_conn.MooncakeKVReceiver)


class _BackendComparison(ast.NodeVisitor):
    """Collects comparisons whose one side is `<x>.disaggregation_transfer_backend`."""

    def __init__(self):
        self.sites = []

    def visit_Compare(self, node):
        operands = [node.left, *node.comparators]
        if len(operands) == 2 and any(
            isinstance(o, ast.Attribute) and o.attr == "disaggregation_transfer_backend" for o in operands
        ):
            self.sites.append(node)
        self.generic_visit(node)


def _string_sites():
    sites = []
    for path in sorted(SGLANG_ROOT.rglob("*.py")):
        text = path.read_text(errors="replace")
        if "disaggregation_transfer_backend" not in text:
            continue
        visitor = _BackendComparison()
        visitor.visit(ast.parse(text))
        for node in visitor.sites:
            sites.append((f"{path.relative_to(SGLANG_ROOT.parent)}:{node.lineno}", node))
    return sites


def _evaluate(node, backend_value):
    """Evaluate a comparison site with the backend attribute bound to `backend_value`."""

    class Bind(ast.NodeTransformer):
        def visit_Attribute(self, attr):
            if attr.attr == "disaggregation_transfer_backend":
                return ast.copy_location(ast.Name(id="__backend__", ctx=ast.Load()), attr)
            return self.generic_visit(attr)

    expr = ast.Expression(Bind().visit(ast.parse(ast.unparse(node), mode="eval").body))
    ast.fix_missing_locations(expr)
    return eval(compile(expr, "<site>", "eval"), {"__backend__": backend_value})


# Each -ext name and the backend name SGLang must see instead, written out by hand.
BASE_NAMES = {"mooncake-ext": "mooncake", "nixl-ext": "nixl", "mori-ext": "mori"}


@pytest.mark.timeout(30)
def test_every_ext_name_has_its_base_written_out_here():
    assert releases.EXT_BACKENDS == BASE_NAMES


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ext_name,base", sorted(BASE_NAMES.items()))
def test_ext_name_reaches_sglang_as_the_base_name(loaded, tiny_model_dir, ext_name, base):
    """What every backend-name comparison in SGLang reads, ``disaggregation_transfer_backend``
    after SGLang's own parsing and post-processing: with the plugin, the -ext name parses to
    exactly the base name (a ``str``, the literal above); stock's parser, the plugin
    deactivated, gives the base name for the base name too."""
    ext_value = _server_args(tiny_model_dir, ext_name).disaggregation_transfer_backend
    assert type(ext_value) is str and ext_value == base, ext_value
    loaded.deactivate()
    assert _server_args(tiny_model_dir, base).disaggregation_transfer_backend == base


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ext_name,base", sorted(BASE_NAMES.items()))
def test_ext_name_takes_base_branch_at_every_string_site(loaded, tiny_model_dir, policy, ext_name, base):
    """Every comparison of ``disaggregation_transfer_backend`` with a literal in the installed
    SGLang, evaluated three ways: with the value SGLang holds for the -ext name (parsed with the
    plugin), with the base name (the literal above) and with the -ext name as typed. Where the
    last two take different branches (the sites the rewrite is for: e.g. 0.5.11
    server_args.py:3788 ``!= "mooncake"``, :3746 ``!= "nixl"``), the parsed value must take the
    base name's branch, not the typed name's; so a plugin that let the -ext name through fails
    here. A release with no such site for a name skips, naming it (the value itself is checked
    above)."""
    sites = _string_sites()
    expected_min = STRING_SITES_BY_RELEASE.get(policy.version)
    if expected_min is not None:
        assert len(sites) >= expected_min, [s for s, _ in sites]
    assert sites
    ext_value = _server_args(tiny_model_dir, ext_name).disaggregation_transfer_backend
    telling = {}
    for where, node in sites:
        try:
            as_base, as_typed = _evaluate(node, base), _evaluate(node, ext_name)
        except NameError:
            continue  # compares against another variable, not a literal: same value, same branch
        if as_base != as_typed:
            telling[where] = (node, as_base, as_typed)
    if not telling:
        pytest.skip(f"n/a on SGLang {policy.version}: none of its {len(sites)} backend-name comparisons tells "
                    f"{ext_name!r} from {base!r}")
    for where, (node, as_base, as_typed) in telling.items():
        assert _evaluate(node, ext_value) == as_base != as_typed, where


@pytest.mark.timeout(300)
def test_enum_sites_take_base_branch(loaded, tiny_model_dir):
    from sglang.srt.disaggregation.utils import TransferBackend

    for ext_name, base in releases.EXT_BACKENDS.items():
        value = _server_args(tiny_model_dir, ext_name).disaggregation_transfer_backend
        assert TransferBackend(value) is TransferBackend(base)


def _run(code, env=None, timeout=240):
    full_env = dict(os.environ)
    full_env.pop("SGLANG_DISAGG_EXT_BACKEND", None)
    full_env.pop("SGLANG_DISAGG_EXT_BACKEND_PID", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env
    )


_PARSE_VIA_SGLANG_LOADER = """
import sys
{load}
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", sys.argv[1] if len(sys.argv) > 1 else {model!r},
    "--skip-tokenizer-init", "--device", "cpu", "--disaggregation-mode", "prefill",
    "--disaggregation-transfer-backend", {backend!r}])
if hasattr(args, "resolve_once"):
    args.resolve_once()
print("BACKEND=" + args.disaggregation_transfer_backend)
"""


def _loader_line(policy):
    if policy.has_plugin_framework:
        return "from sglang.srt.plugins import load_plugins; load_plugins()"
    return "from sglang_disagg_ext.registration import load_plugin; load_plugin()"


@pytest.mark.timeout(300)
def test_unknown_ext_name_fails_at_parsing_listing_valid_names(tiny_model_dir, policy):
    proc = _run(_PARSE_VIA_SGLANG_LOADER.format(load=_loader_line(policy), model=tiny_model_dir, backend="foo-ext"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "invalid choice: 'foo-ext'" in proc.stderr
    for name in ("mooncake", "nixl", "mooncake-ext", "nixl-ext", "mori-ext"):
        assert f"'{name}'" in proc.stderr


@pytest.mark.timeout(300)
def test_sglang_plugins_whitelist_is_respected(tiny_model_dir, policy):
    if not policy.has_plugin_framework:
        # Nothing to whitelist: this release has no plugin loader at all, and
        # the launcher (test_launcher.py) is how the plugin gets loaded.
        assert importlib.util.find_spec("sglang.srt.plugins") is None
        return
    code = _PARSE_VIA_SGLANG_LOADER.format(load=_loader_line(policy), model=tiny_model_dir, backend="mooncake-ext")
    excluded = _run(code, env={"SGLANG_PLUGINS": "some_other_plugin"})
    assert excluded.returncode == 2 and "invalid choice: 'mooncake-ext'" in excluded.stderr
    included = _run(code, env={"SGLANG_PLUGINS": "some_other_plugin,disagg_ext"})
    assert included.returncode == 0, included.stderr[-2000:]
    assert "BACKEND=mooncake" in included.stdout


@pytest.mark.timeout(60)
def test_unsupported_release_is_a_clear_error_at_start(loaded, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(releases, "_current", releases.policy_for("0.5.9"))
    with pytest.raises(releases.UnsupportedSGLangRelease, match=r"does not support SGLang 0\.5\.9; supported releases: every release 0\.5\.10\.post1 through 0\.5\.23"):
        _server_args(tiny_model_dir, "mooncake-ext")
    # The stock names keep working with the plugin installed.
    assert _server_args(tiny_model_dir, "mooncake").disaggregation_transfer_backend == "mooncake"


@pytest.mark.timeout(300)
def test_ext_name_without_its_engine_fails_where_stock_fails(loaded, tiny_model_dir):
    """MoRI is ROCm-only: on this machine `mori-ext` must parse and then fail exactly where `mori` does."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from sglang_disagg_ext.doctor import engine_importable

    assert not engine_importable("mori")
    errors = {}
    for name in ("mori", "mori-ext"):
        value = _server_args(tiny_model_dir, name).disaggregation_transfer_backend
        assert value == "mori"
        with pytest.raises(ImportError) as info:
            get_kv_class(TransferBackend(value), KVClassType.MANAGER)
        errors[name] = type(info.value)
    assert errors["mori"] is errors["mori-ext"]


# -- the backend choice handed to child processes ---------------------------------------

_CHILD_ROUTE = """
from sglang_disagg_ext import registration
registration.load_plugin()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
import os
cls = get_kv_class(TransferBackend("mooncake"), KVClassType.MANAGER)
print(registration.active_backend(), cls.__module__, os.environ.get("SGLANG_DISAGG_EXT_BACKEND"))
"""


@pytest.mark.timeout(300)
def test_choice_made_by_an_ancestor_reaches_the_child(clean_activation, policy):
    """As SGLang's scheduler inherits it: the parent (this test process) made the choice."""
    out = _run(_CHILD_ROUTE, env=clean_activation.selection_env("mooncake-ext"))
    assert out.returncode == 0, out.stderr[-2000:]
    active, module, env = out.stdout.split()
    assert active == "mooncake-ext" and env == "mooncake-ext"
    if policy.routes("mooncake"):
        assert module == "sglang_disagg_ext.backends.mooncake.conn"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("owner", [None, "not-a-pid", "dead"])
def test_stale_choice_in_the_environment_is_ignored(clean_activation, owner):
    """A SGLANG_DISAGG_EXT_BACKEND no ancestor set (an operator's shell, a copied environment)
    never routes the stock name to the plugin's classes, and is not passed on."""
    env = {"SGLANG_DISAGG_EXT_BACKEND": "mooncake-ext"}
    if owner == "dead":
        done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, timeout=60)
        env["SGLANG_DISAGG_EXT_BACKEND_PID"] = done.stdout.strip()
    elif owner is not None:
        env["SGLANG_DISAGG_EXT_BACKEND_PID"] = owner
    out = _run(_CHILD_ROUTE, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "sglang.srt.disaggregation.mooncake.conn", "None"], out.stdout
    assert "ignoring SGLANG_DISAGG_EXT_BACKEND=mooncake-ext" in out.stderr


@pytest.mark.timeout(300)
def test_stock_name_after_an_ext_name_in_one_process_is_stock(loaded, tiny_model_dir):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    _server_args(tiny_model_dir, "mooncake-ext")
    assert os.environ[loaded.SELECTED_BACKEND_ENV] == "mooncake-ext"
    assert os.environ[loaded.SELECTED_BY_ENV] == str(os.getpid())
    _server_args(tiny_model_dir, "mooncake")
    assert loaded.SELECTED_BACKEND_ENV not in os.environ and loaded.SELECTED_BY_ENV not in os.environ
    assert loaded.active_backend() is None
    cls = get_kv_class(TransferBackend("mooncake"), KVClassType.MANAGER)
    assert cls.__module__ == "sglang.srt.disaggregation.mooncake.conn"


@pytest.mark.timeout(300)
def test_release_newer_than_known_passes_through_with_one_warning(tiny_model_dir):
    """After an upgrade past the newest known release the -ext name still starts, as pass-through:
    the stock classes, one WARNING naming the known range. (The installed SGLang stands in for the
    newer release: only the version the plugin reads is changed, in the child process.)"""
    code = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from sglang_disagg_ext import registration, releases
releases._current = releases.policy_for("0.6.0")
registration.load_plugin()
from sglang.srt.server_args import prepare_server_args
for _ in range(2):
    args = prepare_server_args(["--model-path", {tiny_model_dir!r}, "--skip-tokenizer-init", "--device", "cpu",
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake-ext"])
    if releases.features().server_args_resolve_once:
        args.resolve_once()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
cls = get_kv_class(TransferBackend(args.disaggregation_transfer_backend), KVClassType.MANAGER)
print(args.disaggregation_transfer_backend, cls.__module__, registration.active_backend())
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["mooncake", "sglang.srt.disaggregation.mooncake.conn", "mooncake-ext"], out.stdout
    warnings = [line for line in out.stderr.splitlines() if "is newer than the newest release" in line]
    assert len(warnings) == 1, out.stderr[-3000:]
    assert "SGLang 0.6.0 is newer than the newest release sglang-disagg-ext knows (0.5.23): no fix is active" in warnings[0]


@pytest.mark.timeout(300)
def test_resolving_the_same_record_again_keeps_the_choice(loaded, tiny_model_dir, policy):
    """0.5.23's ``resolve_once()`` runs again on a resolved record (a no-op there): the
    record now says "mooncake", rewritten by the plugin, which is not a stock choice."""
    args = _server_args(tiny_model_dir, "mooncake-ext")
    assert args.disaggregation_transfer_backend == "mooncake"
    assert loaded.resolve_ext_backend(args) is None
    assert loaded.active_backend() == "mooncake-ext"
    assert os.environ[loaded.SELECTED_BACKEND_ENV] == "mooncake-ext"
    # A record this process did not rewrite, naming the stock backend, still wins.
    stock = _server_args(tiny_model_dir, "mooncake")
    assert stock.disaggregation_transfer_backend == "mooncake"
    assert loaded.active_backend() is None
