"""check-metrics' progress lines (fsdptrain/check/progress.py): one per pass as it ends, counted, even when it raises."""

from __future__ import annotations

import re

import pytest

from fsdptrain.check.progress import Progress


def test_each_pass_prints_its_count_name_and_seconds(capsys):
    progress = Progress(2)
    assert progress.run("reference", lambda: 7) == 7
    with pytest.raises(ValueError):
        progress.run("padded", lambda: (_ for _ in ()).throw(ValueError("boom")))
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"\(\d+\.\d s\)", "(s)", line) for line in lines] == [
        "check-metrics [1/2] reference (s)", "check-metrics [2/2] padded (s)"]


def test_a_pass_beyond_the_planned_count_raises_the_total_instead_of_printing_3_of_2(capsys):
    progress = Progress(1)
    progress.run("a", lambda: None)
    progress.run("b", lambda: None)
    assert capsys.readouterr().out.splitlines()[-1].startswith("check-metrics [2/2] b (")
