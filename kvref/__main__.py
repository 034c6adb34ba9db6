"""`python -m kvref ...` is the `kvref` command."""

import sys

from .tools.cli import main

sys.exit(main())
