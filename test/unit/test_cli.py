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
    assert out == f"sglang-disagg-ext {version('sglang-disagg-ext')} (SGLang {releases.installed_sglang_version()})"
