"""tests/gpu's lock (one GPU shared by pytest-xdist's workers) and the run order that goes with it,
checked on the CPU: the GPU tests themselves skip here."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import run_order
from tests.helpers.gpu_share import gpu_share, run_lock


class Factory:
    """What `run_lock` reads of pytest's temporary-path factory: a worker's folder inside the run's."""

    def __init__(self, run: Path) -> None:
        self.run = run

    def getbasetemp(self) -> Path:
        return self.run / "popen-gw0"


def test_workers_of_one_run_share_one_lock_in_its_folder_and_a_run_without_workers_has_none(tmp_path):
    worker = SimpleNamespace(workerinput={"workerid": "gw0"})
    assert run_lock(worker, Factory(tmp_path)) == tmp_path / "gpu.lock"
    assert run_lock(SimpleNamespace(), Factory(tmp_path)) is None


def test_shared_holders_overlap_and_an_alone_test_waits_for_both_to_end(tmp_path):
    lock = tmp_path / "gpu.lock"
    events: list[str] = []
    first, second = gpu_share(lock), gpu_share(lock)
    first.__enter__()
    second.__enter__()            # a second shared holder is not held back by the first

    def alone():
        with gpu_share(lock, alone=True):
            events.append("alone started")

    waiting = threading.Thread(target=alone)
    waiting.start()
    time.sleep(0.2)
    events.append("first ends")
    first.__exit__(None, None, None)
    time.sleep(0.2)
    events.append("second ends")
    second.__exit__(None, None, None)
    waiting.join(timeout=10)
    assert events == ["first ends", "second ends", "alone started"]


def test_without_a_lock_nothing_waits():
    with gpu_share(None, alone=True), gpu_share(None, alone=True):
        pass


class Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.name, self.marks = name, marks

    def get_closest_marker(self, name: str):
        return pytest.mark.__getattr__(name) if name in self.marks else None


def test_slow_tests_run_first_and_tests_that_need_the_gpu_alone_last():
    items = [Item("a"), Item("alone", "gpu_alone"), Item("slow-1", "slow"), Item("b"), Item("slow-2", "slow")]
    assert [i.name for i in sorted(items, key=run_order)] == ["slow-1", "slow-2", "a", "b", "alone"]
