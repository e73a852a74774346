"""`python -m plugsearch.trainer.cli ...` = `plugsearch-train ...`."""

from plugsearch.trainer.cli import main

main()
