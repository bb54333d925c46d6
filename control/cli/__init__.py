"""The ``residency`` command line. Each subcommand lives in its own module exposing
``register(subparsers)``, which adds its parser and sets ``func`` to a ``run(args) -> int``."""
