"""`python -m keel.cli ...` is the `keel` command (tests and drills start it this way)."""

import sys

from keel.cli import main

sys.exit(main())
