"""`kvtool bench --suite store` on a connector it does not know: the protocol suite, through the CLI."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.bench.protocol_suite import QUICK
from kvtool.cli import app

runner = CliRunner()

CONNECTOR = '''
"""Whole blocks in a dict, keyed by the chained hash of the prompt's blocks; one layer group."""
import hashlib
from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker

STORE = {}


def block_keys(tokens, tpb):
    digest, keys = hashlib.sha256(), []
    for start in range(0, len(tokens) - tpb + 1, tpb):
        digest.update(repr(list(tokens[start:start + tpb])).encode())
        keys.append(digest.hexdigest())
    return keys


class Sched(KvCacheConnectorScheduler):
    def __init__(self, llm_args):
        super().__init__(llm_args)
        self.tpb = llm_args.kv_cache_config.tokens_per_block
        self.offers = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        keys, first = block_keys(request.prompt_token_ids, self.tpb), num_computed_tokens // self.tpb
        hits = 0
        while first + hits < len(keys) and keys[first + hits] in STORE:
            hits += 1
        self.offers[request.request_id] = hits
        return hits * self.tpb, False

    def update_state_after_alloc(self, request, block_ids):
        pass

    def build_connector_meta(self, scheduler_output):
        meta = {"load": [], "save": []}
        for req in scheduler_output.new_requests:
            keys, first = block_keys(req.new_tokens, self.tpb), req.computed_position // self.tpb
            hits = self.offers.pop(req.request_id, 0)
            for i, key in enumerate(keys):
                if i >= first:
                    meta["load" if i < first + hits else "save"].append((key, req.new_block_ids[i]))
        return meta

    def request_finished(self, request, cache_block_ids):
        return False


class Worker(KvCacheConnectorWorker):
    def register_kv_caches(self, kv_cache_tensor):
        self.kv = kv_cache_tensor

    def start_load_kv(self, stream):
        for key, page in self._metadata["load"]:
            self.kv[page].copy_(STORE[key])

    def wait_for_layer_load(self, layer_idx, stream):
        pass

    def save_kv_layer(self, layer_idx, stream):
        pass

    def wait_for_save(self, stream):
        for key, page in self._metadata["save"]:
            STORE.setdefault(key, self.kv[page].clone())

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return [], []


class CorruptingWorker(Worker):
    def start_load_kv(self, stream):
        super().start_load_kv(stream)
        for _, page in self._metadata["load"]:
            self.kv[page].zero_()


class RaisingWorker(Worker):
    def start_load_kv(self, stream):
        if self._metadata["load"]:
            raise RuntimeError("store unreachable\\n(second line)")


class UnbuildableSched(Sched):
    def __init__(self, llm_args):
        raise ValueError("no store\\nconfigured")


class ForgetfulSched(Sched):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False


class SlowAskSched(Sched):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        import time
        time.sleep(0.5)                          # a slow index lookup: the connector's time, not a transfer
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
'''

QUICK_BLOCKS = QUICK.prompts * QUICK.blocks
COLUMNS = ["connector", "direction", "model", "tokens_per_block", "block_bytes", "blocks", "rounds", "gbps",
           "spread", "p50_us", "p99_us", "connector_ms", "runtime_ms", "raw_gbps", "ratio", "vs_reference", "verified",
           "runtime"]
REFERENCE = "host (kvtool reference, backend torch)"


@pytest.fixture
def tmp_path(tmp_path_factory) -> Path:
    """A short folder for this module's tests. `kvtool bench` prints `results in FOLDER` through rich,
    which wraps at 80 columns without a terminal, and these tests read that line whole: a test's own
    tmp_path under pytest-xdist (/tmp/pytest-of-USER/pytest-N/popen-gw0/test_a_connector_that_loads_wr0)
    is long enough to be wrapped onto a line of its own."""
    return tmp_path_factory.mktemp("b")


@pytest.fixture
def connector_file(tmp_path) -> Path:
    path = tmp_path / "dict_connector.py"
    path.write_text(CONNECTOR)
    return path


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool", "bench", "--suite", "store", "--model", "tiny", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def _all_rows(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())["rows"]


def _rows(out: Path) -> list[dict]:
    """The connector's own rows (kvtool's reference connector's follow them)."""
    return [r for r in _all_rows(out) if r["connector"] != REFERENCE]


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(CONNECTOR.split("\n"), start=1) if text in line)


def _error_line(stderr: str) -> str:
    """The one error line, after the run folder's line (a table's rows were written first)."""
    lines = stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("results in ") and "Traceback" not in stderr
    return lines[1]


def test_a_connector_of_ones_own_is_measured_through_the_engine(connector_file, tmp_path):
    out = tmp_path / "run"
    done = _bench("--connector", f"{connector_file}:Sched:Worker", "--quick", "--format", "json", "--output", str(out))
    assert done.returncode == 0, done.stderr
    rows = _all_rows(out)
    assert json.loads(done.stdout) == rows
    assert [list(r) for r in rows] == [COLUMNS] * 4
    assert [(r["connector"], r["direction"], r["model"], r["tokens_per_block"], r["block_bytes"], r["blocks"],
             r["verified"]) for r in rows] == [(name, d, "tiny", 16, 8192, QUICK_BLOCKS, True)
                                               for name in ("dict_connector.py:Sched:Worker", REFERENCE)
                                               for d in ("save", "load")]
    for r in rows:
        assert r["gbps"] > 0 and r["raw_gbps"] > 0 and 0 < r["p50_us"] <= r["p99_us"]
        assert r["runtime"] == "trtllm-v2-release"
        assert r["ratio"] == pytest.approx(r["gbps"] / r["raw_gbps"], rel=0.01)
    reference = {r["direction"]: r["gbps"] for r in rows[2:]}
    assert [r["vs_reference"] for r in rows[2:]] == [1.0, 1.0]
    for r in rows[:2]:
        assert r["vs_reference"] == pytest.approx(r["gbps"] / reference[r["direction"]], rel=0.01)
    assert (out / "results.csv").read_text().splitlines()[0] == ",".join(COLUMNS)


def test_the_connectors_time_and_the_runtimes_are_told_apart(connector_file, tmp_path):
    """A scheduler whose ask sleeps 0.5 s: the 4 asks of a round are 2 s of connector time, none of
    it in the save or load hooks (so not in GB/s), and not the runtime's (which would have to run
    some 50 times slower than on an idle machine to reach 2 s)."""
    out = tmp_path / "run"
    done = _bench("--connector", f"{connector_file}:SlowAskSched:Worker", "--quick", "--output", str(out))
    assert done.returncode == 0, done.stderr
    slow, reference = _rows(out), [r for r in _all_rows(out) if r["connector"] == REFERENCE]
    for row in slow:
        assert row["connector_ms"] >= 2000 and 0 < row["runtime_ms"] < 2000, row
        assert row["p99_us"] < 500_000, row         # no request's hook time holds a 0.5 s ask
    for row in reference:
        assert row["connector_ms"] > 0 and row["runtime_ms"] > 0, row
    assert "conn ms" in done.stdout and "rt ms" in done.stdout


def test_a_tensorrt_llm_connector_is_measured_under_compat(tmp_path):
    target = "tests/data/trtllm_style_connector.py:BlockFilesLeader:BlockFilesWorker"
    out = tmp_path / "run"
    done = _bench("--connector", target, "--compat", "trtllm", "--quick", "--tokens-per-block", "8",
                  "--tokens-per-block", "16", "--output", str(out),
                  env={"BLOCK_FILES_FOLDER": str(tmp_path / "blocks")})
    assert done.returncode == 0, done.stderr
    assert [(r["direction"], r["tokens_per_block"], r["blocks"], r["verified"]) for r in _rows(out)] == [
        ("save", 8, QUICK_BLOCKS, True), ("load", 8, QUICK_BLOCKS, True),
        ("save", 16, QUICK_BLOCKS, True), ("load", 16, QUICK_BLOCKS, True)]
    assert len(list((tmp_path / "blocks").iterdir())) == 2 * QUICK_BLOCKS      # what it saved, on its own disk
    assert "BlockFilesLeader" in done.stdout                                  # the rich table


def test_a_connector_that_loads_wrong_bytes_is_not_verified(connector_file, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--output", str(tmp_path),
                                 "--connector", f"{connector_file}:Sched:CorruptingWorker"])
    assert result.exit_code == 1
    assert [(r["direction"], r["blocks"], r["verified"]) for r in _rows(tmp_path)] == [
        ("save", QUICK_BLOCKS, False), ("load", QUICK_BLOCKS, False)]
    line = _error_line(result.stderr)
    assert "16 tokens per block: not verified: " in line and "integrity error" in line


def test_a_connector_that_serves_nothing_fails_saying_so(connector_file, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--output", str(tmp_path),
                                 "--connector", f"{connector_file}:ForgetfulSched:Worker"])
    assert result.exit_code == 1
    assert [(r["direction"], r["blocks"], r["verified"]) for r in _rows(tmp_path)] == [
        ("save", QUICK_BLOCKS, True), ("load", 0, True)]
    assert _error_line(result.stderr) == ("kvtool: error: dict_connector.py:ForgetfulSched:Worker, 16 tokens per "
                                          "block: the connector served nothing in the warm round")


def test_a_connector_that_raises_is_one_line(connector_file, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--output", str(tmp_path),
                                 "--connector", f"{connector_file}:Sched:RaisingWorker"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"kvtool: error: connector dict_connector.py:Sched:RaisingWorker: "
                                          "start_load_kv (rank 0) raised RuntimeError: store unreachable (second "
                                          f"line) ({connector_file}:{_line_of('raise RuntimeError')})"]


def test_a_connector_that_cannot_be_constructed_is_exit_2_in_one_line(connector_file, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--output", str(tmp_path),
                                 "--connector", f"{connector_file}:UnbuildableSched:Worker"])
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line == (f"kvtool: error: connector '{connector_file}:UnbuildableSched:Worker' could not be constructed: "
                    f"ValueError: no store configured ({connector_file}:85)")   # the connector's own file and line


@pytest.mark.parametrize("connector", ["host", "tests/data/trtllm_style_connector.py:A:B"])
def test_an_unknown_compat_is_exit_2_in_one_line(connector, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--connector", connector, "--compat", "nope",
                                 "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["kvtool: error: unknown --compat 'nope'; known: trtllm, vllm"]


def test_device_cuda_without_a_gpu_is_a_usage_error(connector_file, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--output", str(tmp_path),
                                 "--connector", f"{connector_file}:Sched:Worker", "--device", "cuda"])
    assert result.exit_code == 2
    assert "--device cuda needs a CUDA GPU" in result.stderr


def test_a_long_output_folder_is_said_on_one_line(connector_file, tmp_path):
    """rich wraps at 80 columns without a terminal: the folder must stay whole, to be copied."""
    out = tmp_path / ("a-long-folder-name-" * 6) / "run"
    done = _bench("--connector", f"{connector_file}:Sched:Worker", "--quick", "--format", "json", "--output", str(out),
                  env={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert f"results in {out}" in done.stderr.splitlines()


def test_a_connector_writing_into_its_working_folder_leaves_nothing_behind(tmp_path):
    """The TensorRT-LLM-style connector keeps its blocks in ./block_files; the bench runs it in a
    temporary folder of its own, as validate does each scenario."""
    target = f"{Path(__file__).parent / 'data' / 'trtllm_style_connector.py'}:BlockFilesLeader:BlockFilesWorker"
    env = {k: v for k, v in os.environ.items() if k != "BLOCK_FILES_FOLDER"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "kvtool", "bench", "--suite", "store", "--model", "tiny", "--quick",
                           "--connector", target, "--compat", "trtllm", "--output", "run"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert all(r["verified"] and r["blocks"] == QUICK_BLOCKS for r in _rows(tmp_path / "run"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_rounds_give_a_median_and_its_spread(connector_file, tmp_path):
    out = tmp_path / "run"
    done = _bench("--connector", f"{connector_file}:Sched:Worker", "--quick", "--repeats", "3", "--output", str(out))
    assert done.returncode == 0, done.stderr
    rows = _all_rows(out)
    assert [(r["rounds"], r["blocks"], r["verified"]) for r in rows] == [(3, QUICK_BLOCKS, True)] * 4
    assert all(r["spread"] is not None and r["spread"] >= 0 for r in rows)
    quick = _bench("--connector", f"{connector_file}:Sched:Worker", "--quick", "--output", str(tmp_path / "one"))
    assert quick.returncode == 0, quick.stderr
    assert [(r["rounds"], r["spread"]) for r in _all_rows(tmp_path / "one")] == [(1, None)] * 4


def test_a_benchmarked_host_store_is_written_whole_before_anything_is_timed():
    """Its pages come from calloc and are committed by the first write into each: without
    `commit_stores` a timed cold save would pay those page faults (0.6 GB/s against 2-3 GB/s on the
    2-core CPU)."""
    from kvtool.bench.protocol_engine import build_engine
    from kvtool.connectors.registry import load_connector
    from tests.helpers.memory import resident_bytes
    gc.collect()                # an earlier test's garbage freed meanwhile would lower the count
    before = resident_bytes()
    engine = build_engine(load_connector("host"), {"capacity": "512MiB"}, "tiny", 16, QUICK, "cpu")
    try:
        assert resident_bytes() - before > 384 << 20
        [rank] = engine.driver.workers
        assert all(int(space.tensor[:: 1 << 12].count_nonzero()) == 0 for space in rank.worker.store.values())
    finally:
        engine.close()
