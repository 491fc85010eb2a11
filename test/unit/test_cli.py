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


# -- selftest: what an operator types, and what comes back -------------------------------------


@pytest.mark.timeout(120)
def test_selftest_list_json_is_one_document_of_the_listed_rows(capsys):
    import json

    assert cli.main(["selftest", "--list"]) == 0
    names = capsys.readouterr().out.splitlines()
    assert cli.main(["selftest", "--list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # one document, nothing else on stdout
    assert [r["scenario"] for r in rows] == names  # the text form lists the same rows, in order
    for r in rows:
        assert set(r) == {"scenario", "backend", "fixes", "runs", "why"}, r
        assert r["backend"] in ("mooncake", "nixl", "mori", "all")
        assert r["fixes"] and all(f.startswith("F") for f in r["fixes"]), r
        assert r["runs"] == (r["why"] is None), r
        assert r["why"] is None or r["why"].strip(), r
    by_name = {r["scenario"]: r for r in rows}
    assert by_name["metadata get_buf isolated from slot reuse"]["fixes"] == ["F5"]
    assert {r["backend"] for r in rows if r["scenario"].startswith("mori-")} == {"mori"}


@pytest.mark.timeout(120)
def test_selftest_list_json_says_why_a_row_is_not_run(monkeypatch, capsys):
    import json

    from sglang_disagg_ext import releases

    # nixl-ext passing through to SGLang's classes: every NIXL row is n/a, with the reason.
    monkeypatch.setattr(releases.ReleasePolicy, "routes", lambda self, backend: backend != "nixl")
    assert cli.main(["selftest", "--list", "--json", "--backend", "nixl-ext"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["backend"] == "nixl"]
    assert rows and all(not r["runs"] and "nixl-ext routes to stock classes" in r["why"] for r in rows)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option,value", [
    ("--timeout", "0"), ("--timeout", "-5"), ("--timeout", "nan"), ("--requests", "0"), ("--wave", "-1"),
    ("--min-rows", "0"), ("--prefill-tp", "0"), ("--decode-tp", "-2"), ("--fault-rate", "-0.1"),
    ("--bad-rate", "1"), ("--requests", "many"),
])
def test_selftest_refuses_numbers_that_make_no_sense_at_parse_time(capsys, option, value):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["selftest", f"{option}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and repr(value) in err, err


@pytest.mark.timeout(60)
def test_selftest_keeps_the_numbers_it_accepted_before():
    args = cli.build_parser().parse_args(
        ["selftest", "--timeout", "0.5", "--min-rows", "3", "--requests", "4", "--wave", "2",
         "--fault-rate", "0", "--bad-rate", "0.25", "--prefill-tp", "2", "--decode-tp", "1", "--seed", "-1"])
    assert (args.timeout, args.min_rows, args.requests, args.wave) == (0.5, 3, 4, 2)
    assert (args.fault_rate, args.bad_rate, args.prefill_tp, args.decode_tp, args.seed) == (0.0, 0.25, 2, 1, -1)


@pytest.mark.timeout(120)
def test_selftest_backend_takes_the_ext_names_as_the_same_engine(capsys):
    parse = cli.build_parser().parse_args
    assert parse(["selftest", "--backend", "mooncake-ext", "--backend", "nixl"]).backend == ["mooncake", "nixl"]
    assert parse(["selftest", "--backend", "mori-ext"]).backend == ["mori"]
    assert cli.main(["selftest", "--list", "--backend", "mooncake"]) == 0
    stock = capsys.readouterr().out
    # Both names given: the engine's rows once.
    assert cli.main(["selftest", "--list", "--backend", "mooncake-ext", "--backend", "mooncake"]) == 0
    assert capsys.readouterr().out == stock
    with pytest.raises(SystemExit) as exc:
        parse(["selftest", "--backend", "mooncake-rdma"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --backend: invalid choice: 'mooncake-rdma'" in err and "mooncake-ext" in err


@pytest.mark.timeout(120)
def test_selftest_scenario_reports_only_the_rows_selected(monkeypatch, capsys):
    from sglang_disagg_ext import releases
    from sglang_disagg_ext.selftest import runner
    from sglang_disagg_ext.selftest.rows import make_row
    from sglang_disagg_ext.selftest.scenarios import metadata_gate

    # The one selected row, an in-process F10 row, stands in for a run (no SGLang manager started);
    # nixl-ext passes through here, so its n/a row would be printed if not limited to the selection.
    monkeypatch.setattr(metadata_gate, "not_run_reason", lambda policy: None)
    monkeypatch.setattr(metadata_gate, "_row", lambda name, *a: make_row(name, "F10", "all", "fail", "pass", True, 0))
    monkeypatch.setattr(releases.ReleasePolicy, "routes", lambda self, backend: backend != "nixl")
    monkeypatch.setattr(runner, "device_preflight", lambda *a, **k: None)
    monkeypatch.setattr(runner, "default_backends", lambda: ["mooncake", "nixl", "mori"])
    selected = metadata_gate.metadata_gate_row_names()[1]
    args = cli.build_parser().parse_args(["selftest", "--scenario", selected])
    assert runner.main(args) == 0
    out = capsys.readouterr()
    assert "not run [" not in out.out and "n/a" not in out.out, out.out
    progress = [line for line in out.err.splitlines() if line.startswith("[selftest] F")]
    assert progress == [f"[selftest] F10 all {selected!r}: stock fail, ext pass, 0.0s"], out.err
    assert "1 of 1 -ext scenarios run here passed" in out.out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [
    ["--help"], ["selftest", "--help"], ["doctor", "--help"], ["launch-pd", "--help"], ["launch-pd", "start", "--help"],
    ["gsm8k", "--help"], ["tiny-model", "--help"],
])
def test_help_is_plain_text(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "``" not in out and ":func:" not in out, out


def test_plain_text_takes_off_rst_markup_only():
    assert cli.plain_text("run ``selftest --list`` or :func:`main`; keep a's and -ext") == \
        "run selftest --list or main; keep a's and -ext"
    assert cli.plain_text(None) is None
