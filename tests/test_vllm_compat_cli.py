"""`--compat vllm` at the command line where vLLM may be absent: bad input and a missing vLLM are
exit 2 in one line, never a traceback (CI runs these without vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.engine.runtimes import DEFAULT_RUNTIME
from kvtool.vllm_compat.install import INSTALL_HINT, vllm_available

runner = CliRunner()
WORKLOADS = Path(__file__).parents[1] / "workloads"


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
@pytest.mark.parametrize("args", [["validate", "--compat", "vllm", "ExampleConnector"],
                                  ["bench", "--suite", "store", "--compat", "vllm", "--connector", "ExampleConnector",
                                   "--model", "tiny", "--quick"]])
def test_without_vllm_a_vllm_run_is_exit_2_with_the_install_line(args, tmp_path):
    result = runner.invoke(app, [*args, "--output", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("kvtool: error: --compat vllm needs vLLM") and line.endswith(INSTALL_HINT)


@pytest.mark.parametrize("option", [["--runtime", str(DEFAULT_RUNTIME)], ["--with-compute"], ["--batch-bytes", "1MiB"]])
def test_a_vllm_store_bench_refuses_what_it_cannot_measure(option, tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--compat", "vllm", "--connector", "ExampleConnector",
                                 "--model", "tiny", *option, "--output", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == ["kvtool: error: --compat vllm measures on CPU pages (vLLM's CPU build), "
                                          "without --with-compute, --runtime or --batch-bytes"]


def test_a_vllm_store_bench_has_no_connector_help():
    result = runner.invoke(app, ["bench", "--suite", "store", "--compat", "vllm", "--connector", "ExampleConnector",
                                 "--connector-help"])
    assert result.exit_code == 2
    assert "--connector-help lists kvtool connectors' options" in result.stderr


def test_the_other_trace_commands_say_they_take_no_vllm_connector():
    from kvtool.errors import InputError
    from kvtool.trace.setup import ReplayOptions, build_replay

    with pytest.raises(InputError, match="this trace command replays through kvtool's engine and does not take "
                                         "a vLLM connector; trace run, validate and bench --suite store take"):
        build_replay(ReplayOptions(WORKLOADS / "shared_prefix.jsonl", connector="host", compat="vllm"))


def test_trace_run_with_vllm_needs_a_connector(tmp_path):
    result = runner.invoke(app, ["trace", "run", str(WORKLOADS / "shared_prefix.jsonl"), "--compat", "vllm",
                                 "--output", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "kvtool: error: --compat vllm replays through a vLLM connector: give --connector TARGET"]


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_without_vllm_trace_run_is_exit_2_before_any_replay(tmp_path):
    result = runner.invoke(app, ["trace", "run", str(WORKLOADS / "shared_prefix.jsonl"), "--compat", "vllm",
                                 "--connector", "ExampleConnector"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.endswith(INSTALL_HINT) and "trace" not in result.stdout
