"""selftest.rows: progress lines are on only inside one CLI run and go to the stderr of the moment.

CI failed once on this: the CLI switched progress on for good with the stream pytest had put in
``sys.stderr`` for one test; a later test in the same worker built rows and wrote to that stream,
closed by then ("I/O operation on closed file").
"""

import io
import sys

import pytest

from sglang_disagg_ext.selftest import rows


def _row():
    return rows.make_row("a scenario", "F1", "mooncake", "fail", "pass", True, 1.234)


@pytest.mark.timeout(10)
def test_progress_is_on_only_inside_the_block_and_follows_the_current_stderr(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    with rows.progress_on_stderr():
        monkeypatch.setattr(sys, "stderr", second)
        _row()
    assert first.getvalue() == ""
    assert second.getvalue() == "[selftest] F1 mooncake 'a scenario': stock fail, ext pass, 1.2s\n"

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    assert _row()["ext"] == "pass"  # off after the block: nothing written to a closed stream


@pytest.mark.timeout(10)
def test_progress_goes_off_when_the_run_raises():
    with pytest.raises(RuntimeError):
        with rows.progress_on_stderr():
            raise RuntimeError("a row's scenario blew up")
    assert rows._progress is False
