"""`python -m trainer.cli ...` = `plugsearch-train ...`."""

from trainer.cli import main

main()
