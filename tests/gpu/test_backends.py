"""Every CUDA backend x direction x chunk shape x random page permutation equals the torch reference
bit for bit; the destination is poisoned before each run. Skipped without a GPU and PyCUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("pycuda")

from kvtool.transfer import CopyOp, PageSpace, available_backends, get_backend  # noqa: E402
from kvtool.transfer import cuda_runtime as rt  # noqa: E402

NUM_SLOTS = 96
SHAPES = [  # (stride, nbytes, src_offset, dst_offset)
    (16384, 16384, 0, 0),      # whole 16 KB pages
    (4096, 4096, 0, 0),
    (65536, 16384, 16384, 16384),  # one layer's chunk inside a larger slot
    (1000, 1000, 0, 0),        # odd size: byte fallback
    (16384, 8000, 8, 24),      # unaligned chunk
]
DIRECTIONS = ["save", "load", "gather", "scatter"]


def space(device: str, stride: int, seed: int) -> PageSpace:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (NUM_SLOTS * stride,), dtype=torch.uint8, generator=gen)
    tensor = data.pin_memory() if device == "cpu" else data.to(device)
    return PageSpace(tensor, stride, stride, NUM_SLOTS)


def endpoints(direction: str, stride: int) -> tuple[PageSpace, PageSpace]:
    src_device, dst_device = {"save": ("cuda", "cpu"), "load": ("cpu", "cuda"), "gather": ("cuda", "cuda"),
                              "scatter": ("cuda", "cuda")}[direction]
    return space(src_device, stride, 1), space(dst_device, stride, 2)


@pytest.fixture(scope="module", params=[b for b in available_backends() if b != "torch"])
def backend(request):
    return get_backend(request.param)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}-{s[2]}-{s[3]}")
@pytest.mark.parametrize("seed", [0, 1])
def test_backend_equals_torch_reference(backend, direction, shape, seed):
    stride, nbytes, src_offset, dst_offset = shape
    src, dst = endpoints(direction, stride)
    gen = torch.Generator().manual_seed(seed)
    count = 64
    src_slots = tuple(torch.randperm(NUM_SLOTS, generator=gen)[:count].tolist())
    dst_slots = (tuple(range(count)) if direction == "save" else
                 tuple(torch.randperm(NUM_SLOTS, generator=gen)[:count].tolist()))
    if direction == "load":
        src_slots = tuple(range(count))
    op = CopyOp(src, dst, src_slots, dst_slots, nbytes, src_offset, dst_offset)
    expected_tensor = dst.tensor.clone()
    expected_tensor.fill_(0xA5)
    expected = PageSpace(expected_tensor.pin_memory() if dst.device.type == "cpu" else expected_tensor,
                         dst.stride, dst.size, dst.num_slots)
    get_backend("torch").copy([CopyOp(src, expected, src_slots, dst_slots, nbytes, src_offset, dst_offset)])
    torch.cuda.synchronize()
    dst.tensor.fill_(0xA5)   # poison
    backend.copy([op])
    backend.synchronize()
    assert torch.equal(dst.tensor.cpu(), expected.tensor.cpu())


def test_mixed_batch_in_one_call(backend):
    a, b = endpoints("save", 16384)
    c, d = endpoints("load", 16384)
    ops = [CopyOp(a, b, (5, 9, 2), (0, 1, 2), 16384), CopyOp(c, d, (0, 1), (40, 7), 16384)]
    b.tensor.fill_(0)
    d.tensor.fill_(0)
    backend.copy(ops)
    backend.synchronize()
    assert torch.equal(b.tensor[:16384].cpu(), a.tensor[5 * 16384:6 * 16384].cpu())
    assert torch.equal(d.tensor[40 * 16384:41 * 16384].cpu(), c.tensor[:16384].cpu())


def _expected(op: CopyOp) -> torch.Tensor:
    """What the destination holds after `op`: the torch reference's copy into a poisoned clone."""
    clone = op.dst.tensor.clone()
    clone.fill_(0xA5)
    target = PageSpace(clone.pin_memory() if op.dst.device.type == "cpu" else clone, op.dst.stride, op.dst.size,
                       op.dst.num_slots)
    get_backend("torch").copy([CopyOp(op.src, target, op.src_slots, op.dst_slots, op.nbytes, op.src_offset,
                                      op.dst_offset)])
    torch.cuda.synchronize()
    return target.tensor.cpu()


@pytest.mark.parametrize("direction", ["save", "load"])
@pytest.mark.parametrize("options", [{"ring": 3, "chunk_bytes": 65536, "first_chunk_bytes": 16384},
                                     {"graphed": True}, {"gather_sms": 2}],
                         ids=["ring3-chunked", "graphed", "2-sm-gather"])
def test_a_prepared_staged_plan_launched_again_and_again_moves_the_right_bytes(direction, options):
    """A ring's buffers in turn, a graph's replays, a small gather grid: the bytes after every launch
    (the source changes between launches, so a launch that copied a stale buffer is caught)."""
    src, dst = endpoints(direction, 16384)
    op = CopyOp(src, dst, tuple(range(0, 64, 2)) if direction == "save" else tuple(range(32)),
                tuple(range(32)) if direction == "save" else tuple(range(1, 65, 2)), 16384)
    backend = get_backend("staged", **options)
    prepared = backend.prepare([op])
    for turn in range(5):
        src.tensor.copy_(torch.randint(0, 256, src.tensor.shape, dtype=torch.uint8))
        expected = _expected(op)
        dst.tensor.fill_(0xA5)
        backend.launch(prepared)
        backend.join()
        torch.cuda.synchronize()
        assert torch.equal(dst.tensor.cpu(), expected), f"launch {turn}"


@pytest.mark.parametrize("backend_name", ["staged", "kernel"])
def test_a_save_from_a_worker_thread_works_frees_in_context_and_the_process_exits_cleanly(tmp_path, backend_name):
    """PyCUDA's context stack is per thread and PyCUDA aborts at exit when one is left pushed: an
    asynchronous connector copies from a worker thread. What a finished copy held is freed with the
    context current (on an H100, validate host-async printed PyCUDA's `event in out-of-thread
    context could not be cleaned up` 30 times a run: leaked allocations). Copies of 64 MiB are still
    running when the launch returns, so `synchronize()` on the worker thread releases them; last, a
    backend dropped on the worker with its copy still running waits for it and frees in context."""
    import subprocess
    import sys
    script = tmp_path / "thread_save.py"
    script.write_text(
        "import concurrent.futures, torch\n"
        "from kvtool.transfer import CopyOp, PageSpace, get_backend\n"
        "page = 1 << 20\n"
        "src = PageSpace(torch.randint(0, 256, (64 * page,), dtype=torch.uint8, device='cuda'), page, page, 64)\n"
        "dst = PageSpace(torch.zeros(64 * page, dtype=torch.uint8).pin_memory(), page, page, 64)\n"
        f"backend = get_backend({backend_name!r})\n"
        "def save():\n"
        "    backend.copy([CopyOp(src, dst, tuple(range(63, -1, -1)), tuple(range(64)), page)])\n"
        "    backend.synchronize()\n"
        "with concurrent.futures.ThreadPoolExecutor(2) as pool:\n"
        "    for f in [pool.submit(save) for _ in range(16)]: f.result()\n"
        "assert torch.equal(dst.tensor.view(64, page), src.tensor.view(64, page).flip(0).cpu())\n"
        "expected = src.tensor.cpu()\n"
        "def drop_in_flight():\n"          # the last reference goes on the worker, copies still running
        f"    own = get_backend({backend_name!r})\n"
        "    own.copy([CopyOp(src, dst, tuple(range(64)), tuple(range(64)), page)])\n"
        "    del own\n"
        "    import gc; gc.collect()\n"
        "    assert torch.equal(dst.tensor, expected), 'dropped before its copy landed'\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as pool:\n"
        "    pool.submit(drop_in_flight).result()\n"
        "torch.cuda.synchronize()\n"
        "assert torch.equal(dst.tensor, src.tensor.cpu())\n"
        "print('ok')\n")
    import os
    from pathlib import Path
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "always"}      # PyCUDA reports a leak as a warning: never filtered out here
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert "PyCUDA ERROR" not in done.stderr and "out-of-thread context" not in done.stderr, done.stderr


def test_staged_saves_launched_back_to_back_without_a_join_each_carry_the_bytes_of_their_launch():
    """No join between launches: the caller overwrites the GPU pages right after each save's launch
    (allowed: the launch orders it after the gather), and each save lands in its own host rows."""
    src, _ = endpoints("save", 16384)
    rounds, pages = 4, tuple(range(0, 64, 2))
    hosts = [space("cpu", 16384, 10 + i) for i in range(rounds)]
    backend = get_backend("staged", ring=3, chunk_bytes=65536, first_chunk_bytes=16384)
    prepared = [backend.prepare([CopyOp(src, host, pages, tuple(range(32)), 16384)]) for host in hosts]
    expected = []
    for turn in range(rounds):
        src.tensor.copy_(torch.randint(0, 256, src.tensor.shape, dtype=torch.uint8))   # on the caller's stream
        expected.append(src.tensor.view(NUM_SLOTS, 16384)[list(pages)].cpu())
        backend.launch(prepared[turn])
    src.tensor.fill_(0xA5)          # after the last launch: must not reach any host row
    backend.join()
    torch.cuda.synchronize()
    for turn, host in enumerate(hosts):
        assert torch.equal(host.tensor.view(NUM_SLOTS, 16384)[:32], expected[turn]), f"launch {turn}"


@pytest.mark.parametrize("direction", ["save", "load"])
@pytest.mark.parametrize("shape", [(1 << 20, 1 << 20, 0, 0), (1 << 20, 768 << 10, 64 << 10, 128 << 10)],
                         ids=["whole-1MiB-pages", "part-of-each-page"])
def test_staged_moves_large_pages_straight_through_the_copy_engine(direction, shape):
    """Pages of at least DEFAULT_DIRECT_RUN_BYTES skip the gather (the plan is DIRECT): runs of
    pages consecutive on both sides go in one plain or strided copy each, and the bytes equal the
    torch reference's; the same batch with the direct path off (gathered) gives the same bytes."""
    from kvtool.transfer.staged_backend import _PlanKind
    stride, nbytes, src_offset, dst_offset = shape
    slots = 24
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 256, (slots * stride,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    host, gpu = PageSpace(data[0].pin_memory(), stride, stride, slots), PageSpace(data[1].cuda(), stride, stride, slots)
    host_slots, gpu_slots = (3, 4, 5, 9, 10, 0, 20), (11, 12, 13, 2, 1, 7, 8)   # runs of 3, 1, 1, 1, 1
    op = (CopyOp(gpu, host, gpu_slots, host_slots, nbytes, src_offset, dst_offset) if direction == "save" else
          CopyOp(host, gpu, host_slots, gpu_slots, nbytes, src_offset, dst_offset))
    expected = _expected(op)
    gathered = _PlanKind.SAVE if direction == "save" else _PlanKind.LOAD
    for direct_run_bytes, batch_runs, kind in ((None, True, _PlanKind.DIRECT), (None, False, _PlanKind.DIRECT),
                                               (0, True, gathered)):
        backend = get_backend("staged", direct_run_bytes=direct_run_bytes, batch_runs=batch_runs)
        prepared = backend.prepare([op])
        assert prepared[0].kind is kind
        if kind is _PlanKind.DIRECT:    # batched where the driver has cuMemcpyBatchAsync_v2 (CUDA 13)
            assert (prepared[0].batch is not None) == (batch_runs and rt.has_memcpy_batch())
        op.dst.tensor.fill_(0xA5)
        backend.launch(prepared)
        backend.synchronize()
        assert torch.equal(op.dst.tensor.cpu(), expected), kind
    graphed = get_backend("staged", graphed=True)     # captured: one call per run, replayed
    prepared = graphed.prepare([op])
    for _ in range(2):
        op.dst.tensor.fill_(0xA5)
        graphed.launch(prepared)
        graphed.synchronize()
        assert torch.equal(op.dst.tensor.cpu(), expected), "graphed"


@pytest.mark.parametrize("direction", ["save", "load", "gather"])
@pytest.mark.parametrize("slot_order", ["consecutive", "shuffled"])
def test_layers_prepared_together_move_each_layers_chunk_bit_for_bit(backend, direction, slot_order):
    """`prepare_layers` (staged: one layer's plan built, the others shifted) launched in layer
    order on one stream: every layer's chunk of every page lands, poisoned bytes elsewhere stay."""
    layers, chunk, stride = 4, 16384, 65536
    src, dst = endpoints(direction, stride)
    gen = torch.Generator().manual_seed(3)
    count = 48
    src_slots = tuple(range(count)) if slot_order == "consecutive" else tuple(
        torch.randperm(NUM_SLOTS, generator=gen)[:count].tolist())
    dst_slots = tuple(range(8, 8 + count))
    ops = [[CopyOp(src, dst, src_slots, dst_slots, chunk, layer * chunk, layer * chunk)] for layer in range(layers)]
    expected = dst.tensor.clone().fill_(0xA5)
    expected_space = PageSpace(expected.pin_memory() if dst.device.type == "cpu" else expected, stride, stride,
                               NUM_SLOTS)
    get_backend("torch").copy([CopyOp(src, expected_space, src_slots, dst_slots, chunk, layer * chunk, layer * chunk)
                               for layer in range(layers)])
    torch.cuda.synchronize()
    dst.tensor.fill_(0xA5)
    stream = torch.cuda.Stream()
    for prepared in backend.prepare_layers(ops):
        backend.launch(prepared, stream)
    backend.synchronize(stream)
    assert torch.equal(dst.tensor.cpu(), expected_space.tensor.cpu())
