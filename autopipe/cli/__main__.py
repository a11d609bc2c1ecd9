"""``python -m autopipe.cli ...`` is the ``autopipe`` command."""

from autopipe.cli import main

raise SystemExit(main())
