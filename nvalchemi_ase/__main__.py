"""``python -m nvalchemi_ase`` runs the ``nvalchemi-ase`` command line."""

from nvalchemi_ase.cli.main import main

raise SystemExit(main())
