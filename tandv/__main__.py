"""``python -m tandv`` runs the ``tandv`` command line."""

from .cli import main

raise SystemExit(main())
