"""`python -m coordinator.cli ...`: the `coordinator` command."""

import sys

from .main import main

sys.exit(main())
