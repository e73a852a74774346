"""`python -m services.stack`: the `plugsearch-stack` command line (services/stack/cli.py)."""

import sys

from services.stack.cli import main

sys.exit(main())
