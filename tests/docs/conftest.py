"""The documentation's commands, counted at the end of a run that collected tests/docs: how many blocks (and
command lines) are run by tests, checked by a named test, or not run."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.docs.test_docs_commands import counts

    tally = counts()
    terminalreporter.write_sep("-", "documented commands")
    terminalreporter.write_line(
        f"blocks: {tally['run']} run by tests/docs, {tally['checked-by']} checked by a named test, "
        f"{tally['not-run']} not run (marked why), {tally['unmarked']} unmarked; command lines (a Python block "
        f"counts one): {tally['run commands']} run, {tally['checked-by commands']} checked, "
        f"{tally['not-run commands']} not run")
