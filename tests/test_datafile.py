"""autopipe.core.datafile: atomic JSON writes, one-line read errors, schema versions."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from autopipe.core.datafile import (
    atomic_write_json,
    atomic_write_text,
    check_version,
    created_mode,
    known_fields,
    load_json_file,
    read_json,
)


class BadFile(ValueError):
    pass


def test_atomic_write_json_writes_the_whole_file_with_open_s_mode(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "plan.json"  # a missing folder is made
    atomic_write_json(path, {"version": 1, "x": [1, 2.5]})
    assert json.loads(path.read_text()) == {"version": 1, "x": [1, 2.5]}
    assert path.read_text().endswith("}\n")
    assert path.stat().st_mode & 0o777 == created_mode(0o666)
    assert os.listdir(path.parent) == ["plan.json"]  # no temp file left behind


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    atomic_write_json(path, {"old": True})
    with pytest.raises(ValueError):  # NaN is not JSON: refused before any file is touched
        atomic_write_json(path, {"t": float("nan")}, strict=True)
    with pytest.raises(TypeError):  # not serialisable: fails before any file as well
        atomic_write_json(path, {"t": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["plan.json"]


def test_an_error_while_writing_removes_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old\n")

    def failing_replace(src: str, dst: object) -> None:
        assert Path(src).name.startswith(".plan.json.") and Path(src).exists()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["plan.json"]


def test_a_symlink_stays_a_link_and_its_target_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("{}\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_json(link, [1])
    assert link.is_symlink() and json.loads(target.read_text()) == [1]


def test_character_devices_are_written_through_not_replaced() -> None:
    atomic_write_text("/dev/null", "anything\n")  # neither replaced nor an error
    assert Path("/dev/null").is_char_device()


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="neither a regular file"):
        atomic_write_text(tmp_path, "x")


def test_read_json_names_the_file_in_one_line(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text('{"a": 1}')
    assert read_json(good, BadFile) == {"a": 1}
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n}')
    with pytest.raises(BadFile, match=r"bad.json: not valid JSON \(.* at line 2\)$"):
        read_json(bad, BadFile)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(BadFile, match=r"bin.json: not a JSON text file \(not UTF-8\)"):
        read_json(binary, BadFile)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(BadFile, match="nested too deeply"):
        read_json(deep, BadFile)
    with pytest.raises(FileNotFoundError):  # OS errors are not format errors
        read_json(tmp_path / "missing.json", BadFile)


def test_check_version_says_what_the_file_is_not() -> None:
    check_version({"units": [], "version": 1}, "units", 1, "profile", BadFile, "re-profile")
    with pytest.raises(BadFile, match="^not an autopipe profile: no 'units' key$"):
        check_version([1, 2], "units", 1, "profile", BadFile, "re-profile")
    with pytest.raises(
        BadFile,
        match=r"^profile schema version 7 is not supported \(expected 1\); re-profile$",
    ):
        check_version({"units": [], "version": 7}, "units", 1, "profile", BadFile, "re-profile")


def test_load_json_file_puts_the_file_name_in_front_of_parse_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"n": 3}')
    assert load_json_file(path, lambda d: d["n"] * 2, BadFile) == 6

    def parse(data: object) -> int:
        raise BadFile("n is negative")

    with pytest.raises(BadFile, match=r"^.*p\.json: n is negative$"):
        load_json_file(path, parse, BadFile)


def test_known_fields_drops_keys_a_newer_writer_added() -> None:
    @dataclasses.dataclass
    class Record:
        a: int
        b: str = ""

    data = {"a": 1, "b": "x", "added_later": 5}
    assert known_fields(Record, data) == {"a": 1, "b": "x"}
    assert known_fields(Record, data, without=("b",)) == {"a": 1}
    assert Record(**known_fields(Record, data)) == Record(1, "x")


def test_created_mode_follows_the_umask() -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    assert created_mode(0o666) == 0o666 & ~umask
    assert created_mode(0o777) == 0o777 & ~umask
