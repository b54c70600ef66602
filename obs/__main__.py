"""``python -m obs`` is the ``obs`` command."""

from obs.cli import main

raise SystemExit(main())
