"""The on-disk kernel cache: nvcc runs once per specialization, never on a hit; anything that
decides the binary (a define, an included header, the architecture) is a miss. Needs nvcc, no GPU."""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtool.transfer import kernel_cache

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"


@pytest.fixture
def nvcc_runs(monkeypatch, tmp_path):
    """The cache in a fresh folder; the list of nvcc command lines run from now on."""
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "cache"))
    runs, real_popen = [], subprocess.Popen

    def counting_popen(command, *args, **kwargs):
        runs.append(command)
        return real_popen(command, *args, **kwargs)
    monkeypatch.setattr(kernel_cache.subprocess, "Popen", counting_popen)
    return runs


def entry_path(sources: Path, options: list[str], arch: str) -> Path:
    """Where copy_pages.cu from `sources` with `options` for `arch` is kept; its folder made."""
    key = kernel_cache._key("copy_pages.cu", kernel_cache._sources(sources), options, arch, kernel_cache._nvcc())
    kernel_cache.cache_dir().mkdir(parents=True, exist_ok=True)
    return kernel_cache.cache_dir() / f"{key}.cubin"


@pytest.fixture
def sources(tmp_path) -> Path:
    """A copy of cuda/ that a test may edit."""
    return Path(shutil.copytree(CUDA_DIR, tmp_path / "cuda"))


@needs_nvcc
def test_the_second_ask_reads_the_binary_without_running_nvcc(nvcc_runs, sources):
    first = kernel_cache.cubin(sources / "copy_pages.cu", ["-O3", "-DKVTOOL_UNROLL=4"], "sm_90")
    assert first[:4] == b"\x7fELF" and len(nvcc_runs) == 1
    assert kernel_cache.cubin(sources / "copy_pages.cu", ["-O3", "-DKVTOOL_UNROLL=4"], "sm_90") == first
    assert len(nvcc_runs) == 1
    entries = sorted(kernel_cache.cache_dir().iterdir())
    assert [p.suffix for p in entries] == [".cubin", ".lock"] and not any(p.name.startswith(".") for p in entries)
    assert entries[0].stat().st_mode & 0o777 == 0o644      # a shared cache folder serves every user


@needs_nvcc
def test_askers_that_miss_together_run_nvcc_once_and_sweep_what_a_killed_writer_left(nvcc_runs, sources):
    args = (sources / "copy_pages.cu", ["-O3", "-DKVTOOL_UNROLL=2"], "sm_90")
    entry = entry_path(sources, *args[1:])
    left = entry.with_name(f".{entry.name}.abc123.tmp")      # atomic_file's temporary of a writer killed mid-write
    left.write_bytes(b"half a binary")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        binaries = list(pool.map(lambda _: kernel_cache.cubin(*args), range(4)))
    assert len(nvcc_runs) == 1 and len(set(binaries)) == 1 and binaries[0][:4] == b"\x7fELF"
    assert not left.exists()


@needs_nvcc
def test_a_damaged_entry_is_a_miss_and_is_replaced(nvcc_runs, sources):
    args = (sources / "copy_pages.cu", ["-O3"], "sm_90")
    good = kernel_cache.cubin(*args)
    [entry] = kernel_cache.cache_dir().glob("*.cubin")
    entry.write_bytes(good[:100].replace(b"\x7fELF", b"\0\0\0\0"))
    assert kernel_cache.cubin(*args) == good and len(nvcc_runs) == 2
    assert entry.read_bytes() == good
    kernel_cache.cubin(*args, fresh=True)                     # what the driver refused: compiled again
    assert len(nvcc_runs) == 3


@needs_nvcc
def test_only_cuda_sources_make_the_key_a_header_in_a_subfolder_does(nvcc_runs, sources):
    args = (sources / "copy_pages.cu", ["-O3"], "sm_90")
    kernel_cache.cubin(*args)
    (sources / "notes.txt").write_text("not a source")
    (sources / "copy_pages.cu~").write_text("an editor's backup")
    kernel_cache.cubin(*args)
    assert len(nvcc_runs) == 1
    (sources / "detail").mkdir()
    (sources / "detail" / "extra.cuh").write_text("// included by nobody yet\n")
    kernel_cache.cubin(*args)
    assert len(nvcc_runs) == 2


@needs_nvcc
def test_a_define_an_included_header_or_the_architecture_changes_the_key(nvcc_runs, sources):
    source = sources / "copy_pages.cu"
    base = kernel_cache.cubin(source, ["-O3", "-DKVTOOL_UNROLL=4"], "sm_90")
    assert kernel_cache.cubin(source, ["-O3", "-DKVTOOL_UNROLL=8"], "sm_90") != base
    assert len(nvcc_runs) == 2
    header = sources / "copy_pages.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    kernel_cache.cubin(source, ["-O3", "-DKVTOOL_UNROLL=4"], "sm_90")
    assert len(nvcc_runs) == 3
    kernel_cache.cubin(source, ["-O3", "-DKVTOOL_UNROLL=4"], "sm_100")
    assert len(nvcc_runs) == 4 and len(list(kernel_cache.cache_dir().glob("*.cubin"))) == 4


@needs_nvcc
def test_a_source_nvcc_refuses_is_a_clear_error_and_stores_nothing(nvcc_runs, sources):
    (sources / "copy_pages.cuh").write_text("this is not C++;\n")
    with pytest.raises(RuntimeError, match=r"nvcc could not compile copy_pages.cu for sm_90: .*error") as raised:
        kernel_cache.cubin(sources / "copy_pages.cu", ["-O3"], "sm_90")
    assert f"{sources}/copy_pages.cuh" in str(raised.value) and "kvtool-nvcc-" not in str(raised.value)
    assert not kernel_cache.cache_dir().exists() or not any(kernel_cache.cache_dir().glob("*.cubin"))


def test_without_nvcc_the_error_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="nvcc is not on PATH"):
        kernel_cache.cubin(CUDA_DIR / "copy_pages.cu", ["-O3"], "sm_90")


@needs_nvcc
def test_an_unwritable_cache_folder_still_returns_the_binary(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(blocker / "cubin"))     # under a file: cannot be created
    assert kernel_cache.cubin(CUDA_DIR / "copy_pages.cu", ["-O3"], "sm_90")[:4] == b"\x7fELF"


@needs_nvcc
def test_what_is_compiled_is_what_was_hashed_not_an_edit_made_meanwhile(monkeypatch, nvcc_runs, sources):
    args = (sources / "copy_pages.cu", ["-O3"], "sm_90")
    original = kernel_cache.cubin(*args, fresh=True)
    header, counting_popen = sources / "copy_pages.cuh", kernel_cache.subprocess.Popen

    def edit_then_compile(command, *more, **kwargs):
        header.write_text("this is not C++;\n")             # an editor saves while nvcc starts
        return counting_popen(command, *more, **kwargs)
    monkeypatch.setattr(kernel_cache.subprocess, "Popen", edit_then_compile)
    assert kernel_cache.cubin(*args, fresh=True) == original


@needs_nvcc
def test_a_missing_source_or_no_home_is_said_or_simply_not_cached(monkeypatch, nvcc_runs, sources):
    with pytest.raises(RuntimeError, match="no CUDA source .*absent.cu"):
        kernel_cache.cubin(sources / "absent.cu", ["-O3"], "sm_90")
    monkeypatch.delenv("KVTOOL_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("no home directory")
    monkeypatch.setattr(kernel_cache.Path, "home", staticmethod(no_home))
    assert kernel_cache.cache_dir() is None
    kernel_cache.cubin(sources / "copy_pages.cu", ["-O3"], "sm_90")
    kernel_cache.cubin(sources / "copy_pages.cu", ["-O3"], "sm_90")
    assert len(nvcc_runs) == 2                                 # compiled each time, stored nowhere


@needs_nvcc
def test_a_holder_stuck_past_nvccs_timeout_is_not_waited_for_longer(monkeypatch, nvcc_runs, sources):
    args = (sources / "copy_pages.cu", ["-O3", "-DKVTOOL_UNROLL=8"], "sm_90")
    entry = entry_path(sources, *args[1:])
    stuck = os.open(entry.with_name(entry.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(stuck, fcntl.LOCK_EX)                # another process, stuck inside nvcc
    monkeypatch.setattr(kernel_cache, "LOCK_WAIT_S", 0.5)     # its own nvcc keeps the full timeout
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        binary = pool.submit(kernel_cache.cubin, *args).result(timeout=60)
    finally:
        os.close(stuck)              # first: a waiter that never gives up would otherwise hang the test
        pool.shutdown()
    assert binary[:4] == b"\x7fELF" and len(nvcc_runs) == 1
