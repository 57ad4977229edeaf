"""`python -m coordinator.cli ...`: the `coordinator` command."""

import sys

from .command import main

sys.exit(main())
