"""tests/helpers/failures_at_once.py: a failing test is named while the run is still going, with and
without pytest-xdist, so a run stopped early still says what failed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CASES = """
import pathlib
import time

import pytest

RELEASE = pathlib.Path({release!r})


@pytest.fixture
def broken():
    raise RuntimeError("no fixture")


def test_passes():
    pass


def test_fails():
    assert 1 == 2


def test_setup_fails(broken):
    pass


def test_waits_for_the_release():
    deadline = time.monotonic() + 120        # a hang guard only: the release normally comes at once
    while not RELEASE.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_failure_is_named_while_the_run_is_still_going(tmp_path, workers):
    """The last test blocks until this test has read both names from the run's output (a pipe, with
    Python's output buffered): the names came before the run could end, not in its summary."""
    (tmp_path / "conftest.py").write_text("from tests.helpers.failures_at_once import pytest_configure  # noqa\n")
    release = tmp_path / "release"
    (tmp_path / "test_cases.py").write_text(CASES.format(release=str(release)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-ra",
                            "-p", "xdist",
                            "-n", workers, "--rootdir", str(tmp_path), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
    wanted = {"FAILED test_cases.py::test_fails", "ERROR test_cases.py::test_setup_fails (at setup)"}
    seen: list[str] = []
    try:
        while not wanted <= set(seen):
            line = run.stdout.readline()
            assert line, f"the run ended before naming its failures: {seen}"
            seen.append(line.strip())
        assert run.poll() is None and not release.exists()       # still blocked in its last test
    finally:
        release.touch()
        rest = run.communicate(timeout=300)[0]
    assert run.returncode == 1
    assert "FAILED test_cases.py::test_fails - assert 1 == 2" in rest               # -ra's summary as before
    assert "1 failed, 2 passed, 1 error" in rest
    assert [line for line in seen + rest.splitlines() if line.startswith("FAILED")] == [
        "FAILED test_cases.py::test_fails", "FAILED test_cases.py::test_fails - assert 1 == 2"]
