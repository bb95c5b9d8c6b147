"""Transfer engine on the CPU: descriptors, chunking, alignment, the torch backend, CUDA sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import InputError, LogicError
from kvtool.transfer import CopyOp, PageSpace, available_backends, get_backend
from kvtool.transfer.descriptors import (
    build_table,
    chunk_bytes,
    grid_blocks,
    op_descriptors,
    reference_copy,
    slot_runs,
    split_by_alignment,
    tables_for,
)

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"


def spaces(num_slots=16, stride=256, size=256, count=2):
    memory = torch.randint(0, 256, (count * num_slots * stride,), dtype=torch.uint8)
    return memory, [PageSpace(memory[i * num_slots * stride:(i + 1) * num_slots * stride], stride, size, num_slots)
                    for i in range(count)]


def test_descriptors_are_addresses_of_each_pair():
    memory, (a, b) = spaces()
    op = CopyOp(a, b, (3, 0), (1, 5), 64, src_offset=16, dst_offset=32)
    descs = op_descriptors(op)
    base = memory.data_ptr()
    assert descs["src"].tolist() == [base + 3 * 256 + 16, base + 16]
    assert descs["dst"].tolist() == [base + 16 * 256 + 256 + 32, base + 16 * 256 + 5 * 256 + 32]
    assert descs["nbytes"].tolist() == [64, 64]


def test_chunks_and_their_starts():
    size = chunk_bytes(8)
    assert size == 4096
    descs = np.zeros(3, dtype=[("src", "<u8"), ("dst", "<u8"), ("nbytes", "<u8")])
    descs["nbytes"] = [4096, 10000, 1]
    table = build_table(descs)
    assert table.chunk_start.tolist() == [0, 1, 4] and table.num_chunks == 5
    assert table.chunks_per_desc == 0          # unlike sizes: the kernel searches
    descs["nbytes"] = 10000
    assert build_table(descs).chunks_per_desc == 3 and build_table(descs).chunk_start.tolist() == [0, 3, 6]
    assert build_table(descs[:0]).num_chunks == 0


def test_unaligned_descriptors_go_to_the_fallback():
    memory, (a, b) = spaces()
    aligned = CopyOp(a, b, (1,), (2,), 64)
    odd_size = CopyOp(a, b, (1,), (3,), 60)
    odd_offset = CopyOp(a, b, (1,), (4,), 64, src_offset=8)
    vector, fallback = tables_for([aligned, odd_size, odd_offset])
    assert len(vector) == 1 and len(fallback) == 2
    assert split_by_alignment(op_descriptors(aligned))[1].size == 0


def test_grid_is_capped_by_sms_not_by_page_count():
    assert grid_blocks(num_chunks=16384, threads=1024, max_blocks=8) == 8
    assert grid_blocks(num_chunks=40, threads=1024, max_blocks=8) == 2
    assert grid_blocks(num_chunks=0, threads=1024, max_blocks=8) == 1


def test_slot_runs():
    assert slot_runs(np.array([3, 4, 5, 9, 10, 2])) == [(0, 3), (3, 2), (5, 1)]
    assert slot_runs(np.array([], dtype=int)) == []


def test_a_chunk_that_leaves_its_slot_is_refused():
    _, (a, b) = spaces()
    with pytest.raises(LogicError, match="leaves its slot"):
        CopyOp(a, b, (0,), (0,), 200, src_offset=100)
    with pytest.raises(LogicError, match="outside"):
        CopyOp(a, b, (16,), (0,), 8)
    with pytest.raises(LogicError, match="as many"):
        CopyOp(a, b, (1, 2), (0,), 8)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stride=st.sampled_from([64, 256, 1000, 4096]), count=st.integers(1, 12))
def test_torch_backend_equals_the_python_reference(data, stride, count):
    num_slots = 16
    memory = torch.randint(0, 256, (2 * num_slots * stride,), dtype=torch.uint8)
    a = PageSpace(memory[:num_slots * stride], stride, stride, num_slots)
    b = PageSpace(memory[num_slots * stride:], stride, stride, num_slots)
    src = data.draw(st.permutations(range(num_slots)))[:count]
    dst = data.draw(st.permutations(range(num_slots)))[:count]
    offset = data.draw(st.integers(0, stride - 1))
    nbytes = data.draw(st.integers(1, stride - offset))
    dst_offset = data.draw(st.integers(0, stride - nbytes))
    op = CopyOp(a, b, tuple(src), tuple(dst), nbytes, offset, dst_offset)
    expected = memory.numpy().copy()
    vector, fallback = tables_for([op])
    for table in (vector, fallback):
        reference_copy(expected, table, memory.data_ptr())
    get_backend("torch").copy([op])
    assert np.array_equal(memory.numpy(), expected)


def test_only_torch_is_available_without_a_gpu_and_pycuda_is_never_imported():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert available_backends() == ["torch"]
    for name in ("kernel", "staged", "memcpy", "batch"):
        with pytest.raises(InputError, match="needs a CUDA GPU"):
            get_backend(name)
    with pytest.raises(InputError, match="unknown transfer backend"):
        get_backend("warp")
    assert "pycuda" not in sys.modules


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", sorted(p.name for p in CUDA_DIR.glob("*.cu")))
def test_cuda_sources_compile_for_sm90(source, tmp_path):
    for unroll in (4, 8):
        done = subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-cubin", f"-DKVTOOL_UNROLL={unroll}", "-Xptxas", "-v",
                               "-I", str(CUDA_DIR), "-o", str(tmp_path / "out.cubin"), str(CUDA_DIR / source)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "spill" not in done.stderr or "0 bytes spill stores" in done.stderr


def test_pipeline_chunks_grow_from_the_first_size_to_the_cap_and_cover_every_row_once():
    from kvtool.transfer.descriptors import pipeline_chunks
    assert pipeline_chunks(4096, 16384, 1 << 20, 8 << 20) == [
        (0, 64), (64, 128), (192, 256), (448, 512), (960, 512), (1472, 512), (1984, 512), (2496, 512),
        (3008, 512), (3520, 512), (4032, 64)]
    assert pipeline_chunks(10, 100, 1 << 20, 0) == [(0, 10)]          # 0: one chunk, no pipelining
    assert pipeline_chunks(3, 2 << 20, 1 << 20, 8 << 20) == [(0, 1), (1, 2)]   # rows larger than a chunk
    assert pipeline_chunks(0, 100, 1000, 1000) == []


def test_auto_backend_is_torch_for_pages_in_host_memory():
    from kvtool.transfer.registry import best_backend
    assert best_backend(torch.device("cpu")) == "torch"


def test_auto_backend_tries_the_gpu_default_once_a_process_and_says_why_it_fell_back(monkeypatch):
    from kvtool.transfer import registry
    tries = []

    def failing(name, **options):
        tries.append(name)
        raise RuntimeError("nvcc is not on PATH")
    monkeypatch.setattr(registry, "get_backend", failing)
    registry._why_gpu_default_cannot_run.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"backend auto: staged cannot run here \(RuntimeError: nvcc is not"):
            assert registry.best_backend(torch.device("cuda")) == "torch"
            assert registry.best_backend(torch.device("cuda")) == "torch"
        assert tries == ["staged"]
    finally:
        registry._why_gpu_default_cannot_run.cache_clear()


def test_the_store_connectors_take_auto_as_their_backend_by_default():
    from kvtool.connectors.store_scheduler import STORE_OPTIONS
    backend = next(o for o in STORE_OPTIONS if o.name == "backend")
    assert backend.default == "auto"
    backend.check("auto")
    with pytest.raises(ValueError, match="known: auto, torch"):
        backend.check("nope")
