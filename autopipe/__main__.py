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
        # A failed distributed run leaves the process group's threads running (it is not
        # destroyed after a failure: that could wait on the dead peer). Python's teardown
        # then destroys them while they are still joinable, and C++ aborts the process
        # (SIGABRT, "terminate called without an active exception") instead of exiting with
        # the code. A successful torchrun rank aborted the same way at exit, after
        # destroy_process_group, in 2 of about 20 launches on a loaded machine (cause not
        # found). Every output is written and flushed by now: leave without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


_exit(main())
