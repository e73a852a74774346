"""`plugsearch-stack`, the local stack as supervised processes (the README's first command), by job:

    corpus.py   which corpus is served (`--corpus`, the shared one, or the downloaded public sample) and where
                its indexes live
    specs.py    the process table: ports, `StackOptions`, each process's command and settings, the index build
    policy.py   which search policy is served (compact, trained, base) and whether it fits the corpus
    cli.py      the command line: options, index build, start, readiness banner, supervision (`main`)

`python -m plugsearch.stack` runs the command line (`__main__.py`). `StackError` is here so that every module
raises the same error without importing another.
"""

from __future__ import annotations


class StackError(RuntimeError):
    """The stack cannot start (bad option, busy port, missing corpus, failed index build)."""
