"""tests/gpu's lock (one GPU shared by pytest-xdist's workers) and the run order that goes with it,
checked on the CPU: the GPU tests themselves skip here."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import run_order
from tests.helpers.gpu_share import gpu_share, run_lock

REPO = Path(__file__).resolve().parents[1]


def test_workers_of_one_run_share_one_lock_in_its_folder_and_a_run_without_workers_has_none(tmp_path):
    worker = SimpleNamespace(workerinput={"workerid": "gw0"}, option=SimpleNamespace(basetemp=str(tmp_path / "gw0")))
    assert run_lock(worker) == tmp_path / "gpu.lock"
    assert run_lock(SimpleNamespace(option=SimpleNamespace(basetemp=str(tmp_path)))) is None


def test_shared_holders_overlap_and_an_alone_holder_waits_for_every_one_to_end(tmp_path):
    lock = tmp_path / "gpu.lock"
    events: list[str] = []
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(contextlib.ExitStack())
        first.enter_context(gpu_share(lock))
        other = stack.enter_context(open(lock, "a"))
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)      # a second shared holder is let in at once

        def alone():
            with gpu_share(lock, alone=True):
                events.append("alone started")
        waiting = threading.Thread(target=alone)
        waiting.start()
        time.sleep(0.2)
        events.append("first ends")
        first.close()
        time.sleep(0.2)
        events.append("second ends")
        fcntl.flock(other, fcntl.LOCK_UN)
        waiting.join(timeout=120)                           # a hang guard
    assert events == ["first ends", "second ends", "alone started"]


TIMED = """
import time
import pytest

LOG = {log!r}


def record(name):
    start = time.time()
    time.sleep(0.5)
    with open(LOG, "a") as log:
        log.write(f"{{name}} {{start}} {{time.time()}}\\n")


@pytest.mark.parametrize("i", range(4))
def test_shared(i):
    record(f"shared-{{i}}")


@pytest.mark.gpu_alone
def test_alone():
    record("alone")
"""


def test_under_pytest_xdist_an_alone_test_overlaps_no_other_and_shared_ones_overlap(tmp_path):
    """tests/gpu/conftest.py's hook itself, in a run of three workers."""
    log = tmp_path / "log"
    (tmp_path / "conftest.py").write_text("from tests.gpu.conftest import pytest_runtest_protocol  # noqa: F401\n"
                                          "def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'gpu_alone: alone')\n")
    (tmp_path / "test_timed.py").write_text(TIMED.format(log=str(log)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    spans = {name: (float(start), float(end))
             for name, start, end in (line.split() for line in log.read_text().splitlines())}
    alone = spans.pop("alone")
    assert len(spans) == 4
    assert all(end <= alone[0] or start >= alone[1] for start, end in spans.values()), spans
    assert sum(start < other_end and other_start < end for start, end in spans.values()
               for other_start, other_end in spans.values()) > len(spans)     # some shared ones ran together


class Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.name, self.marks = name, marks

    def get_closest_marker(self, name: str):
        return getattr(pytest.mark, name) if name in self.marks else None


def test_slow_tests_run_first_and_tests_that_need_the_gpu_alone_last():
    items = [Item("a"), Item("alone", "gpu_alone"), Item("slow-1", "slow"), Item("b"), Item("slow-2", "slow")]
    assert [i.name for i in sorted(items, key=run_order)] == ["slow-1", "slow-2", "a", "b", "alone"]
