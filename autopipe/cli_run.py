"""Compatibility module: ``python -m autopipe.cli_run run ...`` (used by older launch lines)
is ``autopipe run ...``; the command lives in :mod:`autopipe.cli.run`."""

from autopipe.cli import main
from autopipe.cli.run import cmd_run, make_optimizer, save_checkpoint

__all__ = ["cmd_run", "main", "make_optimizer", "save_checkpoint"]

if __name__ == "__main__":
    raise SystemExit(main())
