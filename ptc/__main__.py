"""`python -m ptc` runs the command-line interface."""

from ptc.cli import main

raise SystemExit(main())
