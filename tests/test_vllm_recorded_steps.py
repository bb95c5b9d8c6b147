"""The driver's vLLM-free half proven on steps vLLM 0.32.0's scheduler really took
(tests/data/vllm_steps.json, from tests/data/record_vllm_steps.py): kvtool-host on `tiny`, two
requests that outgrow the cache, r2 preempted and resumed with a new block list, then a follow-up.
Runs without vLLM (CI installs none: .ci/run says why); where vLLM is installed, the recording is
checked to be what vLLM still schedules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtool.engine.fingerprint import PrefixHashes
from kvtool.models import load_model
from kvtool.vllm_compat.block_tables import BlockTables, Scheduled
from kvtool.vllm_compat.fingerprints import FingerprintPages, layer_geometry
from kvtool.vllm_compat.install import vllm_available
from kvtool.vllm_compat.recorded_steps import as_output, recorded_scheduled
from kvtool.vllm_compat.worker import attended

RECORDING = json.loads((Path(__file__).parent / "data" / "vllm_steps.json").read_text())
STEPS = RECORDING["steps"]
RESUMED_AT = next(i for i, s in enumerate(STEPS) if any(c[3] for c in s["cached"]))
PREEMPTED_AT = next(i for i, s in enumerate(STEPS) if s["preempted"])


def test_the_recording_holds_a_preemption_and_a_resume_with_a_new_block_list():
    assert RECORDING["preempted"] == ["r2"] and RECORDING["wrong_reads"] == 0
    assert STEPS[PREEMPTED_AT]["preempted"] == ["r2"]
    (resumed,) = [c for c in STEPS[RESUMED_AT]["cached"] if c[3]]
    assert resumed == ["r2", [[16, 18, 20, 22, 21, 19, 17, 15, 13, 6, 5, 4]], 20, True]


def test_block_tables_follow_vllms_outputs_exactly():
    tables = BlockTables()
    for index, step in enumerate(STEPS):
        assert tables.update(as_output(step)) == recorded_scheduled(step), f"step {index}"
        if index == PREEMPTED_AT:
            assert "r2" not in tables           # a preempted request's table is dropped
    r2 = recorded_scheduled(STEPS[RESUMED_AT])
    assert [s for s in r2 if s.request_id == "r2"] == [
        Scheduled("r2", 20, 20 + STEPS[RESUMED_AT]["num_scheduled"]["r2"],
                  ((16, 18, 20, 22, 21, 19, 17, 15, 13, 6, 5, 4),))]


def _replay(load_shift: int = 0) -> dict[int, int]:
    """Every recorded step on fingerprinted pages: a connector that loads a new or resumed
    request's computed prefix (into blocks shifted by `load_shift`), the step's positions written,
    every attended position checked. Wrong reads per step."""
    spec = load_model("tiny")
    geometry = layer_geometry(spec)
    size = RECORDING["block_size"]
    tensors = {name: torch.zeros(64, g.num_heads, size, 2 * g.head_bytes, dtype=torch.uint8)   # key, value
               for name, g in geometry.items()}
    pages = FingerprintPages(tensors, geometry, size)
    tables, hashes, wrong = BlockTables(), {}, {}
    for index, step in enumerate(STEPS):
        arriving = {n[0] for n in step["new"]} | {c[0] for c in step["cached"] if c[3]}
        for s in tables.update(as_output(step)):
            h = hashes.setdefault(s.request_id, _hashes(s.request_id))
            blocks = list(s.blocks[0])
            for name in tensors:
                if s.request_id in arriving and s.start:
                    loaded = blocks[load_shift:] + blocks[:load_shift] if load_shift else blocks
                    pages.write(name, loaded, h, 0, s.start)
                pages.write(name, blocks, h, s.start, s.end)
                wrong[index] = wrong.get(index, 0) + pages.check(s.request_id, name, blocks, h,
                                                                 list(attended(s.start, s.end, None)))[0]
    return wrong


def _hashes(request_id: str) -> np.ndarray:
    hashes = PrefixHashes(0)
    hashes.extend_to([(sum(map(ord, request_id)) * 7 + i) % 1000 for i in range(128)])
    return hashes.array()


def test_a_replay_with_a_right_connector_reads_every_byte_right():
    assert sum(_replay().values()) == 0


def test_a_replay_with_a_shifted_load_reads_the_resumed_prefix_wrong_in_every_layer():
    wrong = _replay(load_shift=1)
    layers = len(load_model("tiny").layers)
    assert wrong[RESUMED_AT] == 20 * layers       # the 20 loaded positions of r2, each layer
    assert {i for i, n in wrong.items() if n} >= {RESUMED_AT}


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install -e '.[vllm]')")
def test_the_recording_is_what_vllm_still_schedules():
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_vllm_steps", Path(__file__).parent / "data" /
                                                  "record_vllm_steps.py")
    assert spec is not None and spec.loader is not None
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    assert recorder.record() == RECORDING
