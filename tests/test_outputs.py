"""``autopipe.outputs``: why a path cannot be written, in one line naming the flag or field,
asked before any work (the CLI's ``check_output_path`` and the API share it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from autopipe.core.errors import UsageError
from autopipe.outputs import check_output, output_path_problem


def test_writable_paths_have_no_problem_and_leave_nothing_behind(tmp_path: Path) -> None:
    assert output_path_problem(tmp_path / "new" / "deeper" / "t.json", "trace_path") is None
    assert output_path_problem(str(tmp_path), "out_dir", directory=True) is None
    assert output_path_problem(tmp_path / "new", "out_dir", directory=True) is None
    assert output_path_problem("/dev/null", "trace_path") is None
    assert list(tmp_path.iterdir()) == []  # no probe file left, no folder made


def test_each_problem_is_one_line_naming_the_label_and_the_path(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("")
    cases = [
        (("", "trace_path"), {}, "trace_path is empty; give a path"),
        ((model, "out_dir"), {"directory": True}, f"out_dir {model} is a file; give a directory"),
        ((tmp_path, "trace_path"), {}, f"trace_path {tmp_path} is a directory; give a file"),
        ((model, "trace_path"), {"inputs": [None, f"{model}:build"]},
         f"trace_path {model} is the input {model}:build; writing there would destroy it: "
         "give another path"),
        ((model, "trace_path"), {"inputs": [model]},
         f"trace_path {model} is the input {model}; writing there would destroy it: "
         "give another path"),
        ((model / "t.json", "--json"), {}, f"--json {model / 't.json'}: {model} is a file, "
         "not a directory"),
    ]  # fmt: skip
    for args, options, says in cases:
        assert output_path_problem(*args, **options) == says
        with pytest.raises(UsageError, match=f"^{re.escape(says)}$"):
            check_output(*args, **options)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_that_takes_no_new_file_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert output_path_problem(locked / "t.json", "trace_path") == (
        f"trace_path {locked / 't.json'}: cannot write in {locked} (Permission denied); "
        "give a writable path"
    )
