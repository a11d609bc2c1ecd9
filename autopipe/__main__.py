"""``python -m autopipe`` (and ``torchrun ... -m autopipe run ...``) is the ``autopipe`` command.

``main()`` reads this process's own command line: ``run`` re-executes the process with
``PYTHONHASHSEED=0`` when it is unset (:func:`autopipe.cli.run.fix_hash_seed`), so every
rank torchrun starts traces the model into the same graph."""

import os
import sys

from autopipe.cli import main


def _exit(code: int) -> None:
    dist = sys.modules.get("torch.distributed")
    used = dist is not None and dist.is_available() and "TORCHELASTIC_RUN_ID" in os.environ
    if used or (code and dist is not None and dist.is_available() and dist.is_initialized()):
        # A distributed rank leaves without Python's teardown, which can abort it (see
        # exit_process); every output is written and flushed by now.
        from autopipe.runtime.distributed.process import exit_process

        exit_process(code)
    raise SystemExit(code)


_exit(main())
