"""The one console script: check commands and the deployment tools as subcommands."""

import pytest

from sglang_disagg_ext import cli


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,prog", [("launch-pd", "launch_pd"), ("gsm8k", "gsm8k"), ("tiny-model", "tiny_model")])
def test_deploy_subcommand_hands_its_arguments_to_the_tool(name, prog, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


@pytest.mark.timeout(30)
def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("doctor", "selftest", *cli.DEPLOY_COMMANDS):
        assert name in out


@pytest.mark.timeout(30)
def test_version_names_plugin_and_sglang(capsys):
    from importlib.metadata import version

    from sglang_disagg_ext import releases

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    from sglang_disagg_ext import __version__, build_info

    assert version("sglang-disagg-ext") == __version__
    commit = build_info.commit()
    assert commit != "unknown" and len(commit) == 12  # a checkout: git names it
    assert out == f"sglang-disagg-ext {__version__} (commit {commit}) (SGLang {releases.installed_sglang_version()})"


@pytest.mark.timeout(60)
def test_selftest_list_names_the_rows_and_runs_nothing(capsys):
    assert cli.main(["selftest", "--list", "--backend", "mooncake"]) == 0
    names = capsys.readouterr().out.splitlines()
    # Hand-listed: the Mooncake F1 rows of every release, and the three F5 rows.
    for name in ("swa 5 vs 3 pages", "swa 3 vs 2 pages", "nsa 3 vs 5 pages",
                 "metadata get_buf isolated from slot reuse", "NSA _clear_buffers releases index_k"):
        assert name in names
    assert not any(line.startswith("[selftest]") for line in names)


def _rows(*exts):
    return [{"scenario": f"row {i}", "fix": "F6", "stock": "n/a", "ext": e, "not_run": "n/a on this release",
             "bytes_verified": None, "seconds": 0.0} for i, e in enumerate(exts)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exts,min_rows,code", [
    (("n/a", "n/a"), 1, 1),  # nothing ran: the node is not checked
    (("pass", "n/a"), 1, 0),
    (("pass", "n/a"), 2, 1),  # --min-rows 2, one ran
    (("pass", "pass"), 2, 0),
])
def test_selftest_fails_when_fewer_rows_ran_than_asked(monkeypatch, capsys, exts, min_rows, code):
    from sglang_disagg_ext.selftest import runner

    monkeypatch.setattr(runner, "collect_rows", lambda *a, **k: _rows(*exts))
    monkeypatch.setattr(runner, "device_preflight", lambda *a, **k: None)
    args = cli.build_parser().parse_args(["selftest", "--backend", "mooncake", "--min-rows", str(min_rows)])
    assert runner.main(args) == code
    out = capsys.readouterr()
    assert ("fewer than" in out.err) == (code == 1)
    # The shared reason is printed once, naming how many rows it covers.
    assert out.out.count("n/a on this release") == (1 if "n/a" in exts else 0)


@pytest.mark.timeout(60)
def test_a_verify_setting_that_is_neither_on_nor_off_is_named(monkeypatch):
    from sglang_disagg_ext import verification

    monkeypatch.setenv(verification.VERIFY_ENV, "banana")
    assert not verification.enabled()
    assert "SGLANG_DISAGG_EXT_VERIFY='banana' is neither on" in verification.invalid_setting()
    for value in ("1", "on", "", "0", "off", "require", "REQUIRE"):
        monkeypatch.setenv(verification.VERIFY_ENV, value)
        assert verification.invalid_setting() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value,mode,enabled,required", [
    ("", "off", False, False), ("0", "off", False, False), ("1", "on", True, False), ("on", "on", True, False),
    ("require", "require", True, True), (" Require ", "require", True, True), ("banana", "off", False, False),
])
def test_verify_modes(monkeypatch, value, mode, enabled, required):
    from sglang_disagg_ext import verification

    monkeypatch.setenv(verification.VERIFY_ENV, value)
    assert (verification.mode(), verification.enabled(), verification.required()) == (mode, enabled, required)


@pytest.mark.timeout(300)
def test_python_dash_m_runs_the_command_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sglang_disagg_ext", "--help"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0 and "doctor" in out.stdout and "``" not in out.stdout
