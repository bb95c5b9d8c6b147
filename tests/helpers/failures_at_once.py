"""A pytest plugin that names each failing test the moment it fails, so that a run stopped early
(Ctrl-C, a CI time limit, a killed terminal) still says what failed; `-ra` (pyproject.toml) lists
them again at the end. Under pytest-xdist it lives in the controller, which receives every
worker's reports (the workers' terminals are not shown). tests/conftest.py imports the hook."""

from __future__ import annotations

import pytest

_STAGE = {"setup": "at setup", "teardown": "at teardown"}


def pytest_configure(config: pytest.Config) -> None:
    """Register `FailuresAtOnce` in the process that owns the terminal (not in an xdist worker)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(FailuresAtOnce(config), "kvtool-failures-at-once")


class FailuresAtOnce:
    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """`FAILED <nodeid>` for a failed test body, `ERROR <nodeid> (at setup|teardown)` for a failed
        fixture, written and flushed at once. Not with -v: pytest already writes a line per test then."""
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if not report.failed or terminal is None or self.config.option.verbose > 0:
            return
        line = f"FAILED {report.nodeid}" if report.when == "call" else f"ERROR {report.nodeid} ({_STAGE[report.when]})"
        if terminal._tw.width_of_current_line:    # after progress characters (xdist's are not a line)
            terminal.write("\n")
        terminal.write_line(line, red=True, bold=True)
        terminal.flush()
