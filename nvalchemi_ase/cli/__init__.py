"""The ``nvalchemi-ase`` command line: one module per subcommand, lazy imports."""
