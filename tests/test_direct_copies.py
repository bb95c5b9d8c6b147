"""The staged backend's direct path, planned on the CPU: which runs of pages go in one copy-engine
call, when a batch skips the gather, and the bytes those calls move (run here by `memmove` on live
host tensors, as the copy engine runs them on a GPU: tests/gpu/test_backends.py checks that)."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.transfer import CopyOp, PageSpace, get_backend
from kvtool.transfer.descriptors import (
    PitchedCopy,
    direct_copies,
    paired_runs,
    reference_pitched_copies,
    reference_run_batch,
    run_batch,
)


def test_runs_are_taken_in_host_order_and_break_where_either_side_jumps():
    host, gpu = (5, 6, 7, 2, 3, 9), (10, 11, 12, 0, 4, 13)
    assert paired_runs(host, gpu) == [(2, 0, 1), (3, 4, 1), (5, 10, 3), (9, 13, 1)]
    assert paired_runs((), ()) == []
    assert paired_runs((0, 1, 2, 3), (8, 9, 10, 11)) == [(0, 8, 4)]


def spaces(stride: int, slots: int, seed: int) -> tuple[PageSpace, PageSpace]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (slots * stride,), dtype=torch.uint8, generator=gen)
    dst = torch.full((slots * stride,), 0xA5, dtype=torch.uint8)
    return PageSpace(src, stride, stride, slots), PageSpace(dst, stride, stride, slots)


def test_a_batch_goes_direct_only_where_its_runs_average_the_threshold():
    src, dst = spaces(1024, 16, 0)
    three_runs = CopyOp(src, dst, (0, 1, 2, 3, 8, 12), (4, 5, 6, 7, 0, 9), 1024)     # host side: dst
    assert direct_copies(three_runs, 2048) == [
        PitchedCopy(dst.address(0), 1024, src.address(8), 1024, 1024, 1),
        PitchedCopy(dst.address(4), 1024, src.address(0), 1024, 1024, 4),
        PitchedCopy(dst.address(9), 1024, src.address(12), 1024, 1024, 1)]
    assert direct_copies(three_runs, 2049) is None       # 6 KiB over 3 runs: 2048 each
    assert direct_copies(three_runs, 0) is None          # 0: always gather


def test_part_of_each_page_is_one_strided_copy_per_run():
    src, dst = spaces(4096, 8, 1)
    op = CopyOp(src, dst, (2, 3, 4), (5, 6, 7), 1000, 96, 2000)
    (copy,) = direct_copies(op, 1)
    assert copy == PitchedCopy(dst.address(5, 2000), 4096, src.address(2, 96), 4096, 1000, 3)
    assert not copy.is_flat and PitchedCopy(0, 64, 0, 64, 64, 3).is_flat


SLOTS = 32


def random_batch(data, stride: int, count: int) -> tuple[CopyOp, PageSpace]:
    """A batch of `count` random slot pairs, a random chunk inside each slot, and a copy of its
    destination as it was (to apply a reference to)."""
    nbytes = data.draw(st.integers(1, stride))
    src_offset, dst_offset = data.draw(st.integers(0, stride - nbytes)), data.draw(st.integers(0, stride - nbytes))
    src_slots = tuple(data.draw(st.permutations(range(SLOTS)))[:count])
    dst_slots = tuple(data.draw(st.permutations(range(SLOTS)))[:count])
    src, dst = spaces(stride, SLOTS, count)
    return (CopyOp(src, dst, src_slots, dst_slots, nbytes, src_offset, dst_offset),
            PageSpace(dst.tensor.clone(), stride, stride, SLOTS))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stride=st.sampled_from([64, 256, 1000]), count=st.integers(1, 24))
def test_direct_copies_move_exactly_the_bytes_the_torch_backend_moves(data, stride, count):
    """Random slot pairs, a chunk inside each slot: the planned calls, run by memmove, leave the
    destination bit for bit as the torch reference does (pages outside the batch untouched)."""
    op, expected = random_batch(data, stride, count)
    get_backend("torch").copy([replace(op, dst=expected)])
    reference_pitched_copies(direct_copies(op, 1))
    assert torch.equal(op.dst.tensor, expected.tensor)


def test_a_run_batch_holds_the_plain_runs_in_order_and_leaves_the_strided_ones_out():
    plain, strided, one_row = (PitchedCopy(100, 64, 900, 64, 64, 3), PitchedCopy(5000, 4096, 7000, 4096, 1000, 3),
                               PitchedCopy(300, 8, 400, 16, 8, 1))
    batch = run_batch([plain, strided, one_row])
    assert batch.dsts.tolist() == [100, 300] and batch.srcs.tolist() == [900, 400]
    assert batch.sizes.tolist() == [192, 8] and batch.strided == (strided,)
    assert len(run_batch([]).sizes) == 0


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stride=st.sampled_from([64, 256, 1000]), count=st.integers(1, 24))
def test_a_run_batch_moves_exactly_the_bytes_its_runs_move(data, stride, count):
    """The batched form of a direct plan (one batched call for the plain runs, one 2D copy per
    strided run), run by memmove, leaves the destination as the runs one by one do."""
    op, one_by_one = random_batch(data, stride, count)
    reference_pitched_copies(direct_copies(replace(op, dst=one_by_one), 1))
    reference_run_batch(run_batch(direct_copies(op, 1)))
    assert torch.equal(op.dst.tensor, one_by_one.tensor)
