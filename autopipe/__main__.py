"""``python -m autopipe`` (and ``torchrun ... -m autopipe run ...``) is the ``autopipe`` command."""

from autopipe.cli import main

raise SystemExit(main())
