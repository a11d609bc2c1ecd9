"""autopipe/saving.py: what a failed save says about the folders it leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autopipe.core.errors import Failure
from autopipe.saving import save_checkpoint


class _Pipe:
    def state_dict(self) -> dict[str, Any]:
        return {}


def test_a_rank_whose_save_fails_names_the_unfinished_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a rank other than 0 said only "DIR is as it was": when rank 0 was killed
    too, its staging folder stayed behind unnamed."""
    staging = tmp_path / ".ckpt.saving-abc123"
    staging.mkdir()

    def broadcast(objects: list[Any], src: int) -> None:
        objects[:] = [staging.name, None]  # what rank 0 sends: the folder, no error

    def lost(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(dcp, "save", lost)
    with pytest.raises(Failure) as info:
        save_checkpoint(_Pipe(), str(tmp_path / "ckpt"))  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and f"{tmp_path / 'ckpt'} is as it was" in message
    assert f"its unfinished copy {staging} is deleted by rank 0" in message
    assert staging.exists()  # rank 1 leaves it to rank 0


def test_state_dict_given_a_checkpoint_folder_says_how_to_convert_it(tmp_path: Path) -> None:
    """Before: "state_dict file not found: ckpt" for the folder ``run --save`` wrote. The
    command the line gives converts it, and the converted file loads."""
    import shlex
    import subprocess
    import sys

    import torch

    from autopipe.core.errors import UsageError
    from autopipe.training import _load_state_dict

    ckpt = tmp_path / "ckpt"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=ckpt, no_dist=True)
    with pytest.raises(UsageError) as info:
        _load_state_dict(str(ckpt))
    message = str(info.value)
    assert "\n" not in message and "torch.distributed.checkpoint folder" in message
    command = message.split("`")[1]
    assert command.startswith("python -m ")
    argv = [sys.executable, *shlex.split(command)[1:]]
    subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    loaded = _load_state_dict(str(tmp_path / "weights.pt"))
    assert loaded is not None and torch.equal(loaded["w"], torch.arange(4.0))
