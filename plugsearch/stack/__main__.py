"""`python -m plugsearch.stack`: the `plugsearch-stack` command line (plugsearch/stack/cli.py)."""

import sys

from plugsearch.stack.cli import main

sys.exit(main())
