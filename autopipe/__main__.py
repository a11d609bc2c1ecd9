"""``python -m autopipe`` (and ``torchrun ... -m autopipe run ...``) is the ``autopipe`` command.

``main()`` reads this process's own command line: ``run`` re-executes the process with
``PYTHONHASHSEED=0`` when it is unset (:func:`autopipe.cli.run.fix_hash_seed`), so every
rank torchrun starts traces the model into the same graph; a distributed rank then leaves
without Python's teardown (:func:`autopipe.cli.console`)."""

from autopipe.cli import console

console()
