"""`python -m ptc` runs the command-line interface."""

from ptc.cli import entry

raise SystemExit(entry())
