"""Shared fixtures. Tests run inside a venv built by `make setup` for one SGLang release.

Required parts and skips. A test skips for one of two kinds of reason:

* n/a on this release or machine (pass-through release, no GPU, ...): a plain
  ``pytest.skip`` / ``skipif`` whose reason says why it is n/a there;
* a required part is missing (an engine -- Mooncake, NIXL --, the MoRI stand-in,
  a module of the plugin): ``required_part(...)`` (a mark) or
  ``require_or_skip(...)`` (in a test body). Their reason starts with
  ``MISSING_PART``. With ``SGLANG_DISAGG_EXT_REQUIRE_ALL=1`` (set by ``.ci/run``)
  such a skip is reported as a failure, and so is any ``importorskip`` skip
  ("could not import ..."): in CI a broken engine install or an ImportError in
  plugin code fails the run instead of silently removing F3/F4. Without the
  switch (``make test`` on a laptop) they stay skips, with the reason.
"""

import json
import os

import pytest

from sglang_disagg_ext import releases

REQUIRE_ALL_ENV = "SGLANG_DISAGG_EXT_REQUIRE_ALL"
# Every skip reason for a missing required part starts with this.
MISSING_PART = "required part missing: "
# pytest.importorskip's reason: every module this suite imports that way is required.
_IMPORTORSKIP = "could not import "
# Engines every release's venv installs (requirements/), checked once per CI session
# whatever the test files do with them.
REQUIRED_ENGINES = ("mooncake", "nixl")


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def missing_part_reason(what: str, why: str = "") -> str:
    return MISSING_PART + what + (f" ({why})" if why else "")


def required_part(what: str, available: bool, why: str = ""):
    """A ``skipif`` mark for a required part; a failure under ``SGLANG_DISAGG_EXT_REQUIRE_ALL``."""
    return pytest.mark.skipif(not available, reason=missing_part_reason(what, why))


def require_or_skip(what: str, available: bool, why: str = "") -> None:
    """In a test or fixture: skip (locally) or fail (CI switch set) when a required part is missing."""
    if available:
        return
    reason = missing_part_reason(what, why)
    if require_all():
        pytest.fail(f"{reason}; {REQUIRE_ALL_ENV} is set, so this is a failure, not a skip", pytrace=False)
    pytest.skip(reason)


def _skip_reason(longrepr) -> str:
    # A skip's longrepr is (path, lineno, "Skipped: <reason>").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
        return text[len("Skipped: "):] if text.startswith("Skipped: ") else text
    return str(longrepr)


def _is_missing_part(reason: str) -> bool:
    return reason.startswith(MISSING_PART) or reason.startswith(_IMPORTORSKIP)


def _fail_instead(report) -> None:
    reason = _skip_reason(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{reason}\n{REQUIRE_ALL_ENV} is set: a missing required part is a failure, not a skip"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if require_all() and report.skipped and not hasattr(report, "wasxfail"):
        if _is_missing_part(_skip_reason(report.longrepr)):
            _fail_instead(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    # A module-level importorskip skips the whole file at collection.
    if require_all() and report.skipped and _is_missing_part(_skip_reason(report.longrepr)):
        _fail_instead(report)


def _missing_engines():
    from sglang_disagg_ext.doctor import ENGINE_MODULES

    missing = []
    for engine in REQUIRED_ENGINES:
        try:
            __import__(ENGINE_MODULES[engine])
        except Exception as e:  # noqa: BLE001 - a broken native library is missing too
            missing.append(f"{engine} ({ENGINE_MODULES[engine]}: {type(e).__name__}: {e})")
    return missing


def pytest_sessionfinish(session, exitstatus):
    """Under the CI switch the engines must import, whatever skip reasons the test files use."""
    if not require_all():
        return
    missing = _missing_engines()
    if missing:
        session.config._disagg_ext_missing = missing
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    missing = getattr(config, "_disagg_ext_missing", None)
    if missing:
        terminalreporter.section("required parts missing", sep="=", red=True, bold=True)
        for m in missing:
            terminalreporter.line(f"{missing_part_reason(m)} -- {REQUIRE_ALL_ENV} is set: the run fails")

# A 2-layer llama config is all ServerArgs needs on CPU (no weights are read).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session")
def policy():
    return releases.current_policy()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return str(path)


@pytest.fixture
def clean_activation():
    """Undo any -ext activation a test performs in this process."""
    from sglang_disagg_ext import registration

    names = (registration.SELECTED_BACKEND_ENV, registration.SELECTED_BY_ENV)
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    yield registration
    registration.deactivate()
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(saved)
