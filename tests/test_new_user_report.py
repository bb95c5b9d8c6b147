"""A new user's report, one section per problem, each a test that fails without its fix:
1. a TensorRT-LLM connector run without `--compat trtllm`; 2. an abstract method left out, blamed on
kvtool's file; 3. local-prefix's evidence read as a contradiction; 4. a mistyped model name, and
the line a config file's model prints; 5. what `stream` the worker hooks get."""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector import KvCacheConnectorWorker
from kvtool.connector.request import Request
from kvtool.connectors.registry import load_connector
from kvtool.engine.worker_setup import forward_stream
from kvtool.errors import InputError
from kvtool.models import load_model
from tests.helpers.engines import make_engine
from tests.helpers.mock_connector import mock_connector

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "dict_connector.py")
SHIPPED = str(REPO / "workloads" / "shared_prefix.jsonl")
HINT = " (a connector written against TensorRT-LLM: add --compat trtllm)"


def _trtllm_modules() -> list[str]:
    return [name for name in sys.modules if name == "tensorrt_llm" or name.startswith("tensorrt_llm.")]


@pytest.fixture
def no_trtllm(monkeypatch):
    """TensorRT-LLM absent, as on the user's machine (an earlier test's --compat may have put
    kvtool's modules under its name into this process); what this test installs goes again."""
    for name in _trtllm_modules():
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in _trtllm_modules():
        del sys.modules[name]     # then monkeypatch puts the earlier ones back


def _trtllm_connector(folder: Path, module: str = "tensorrt_llm._torch.pyexecutor.kv_cache_connector") -> Path:
    path = folder / "myconn_trt.py"
    path.write_text(f"from {module} import KvCacheConnectorScheduler, KvCacheConnectorWorker\n\n"
                    "class MyScheduler(KvCacheConnectorScheduler):\n    pass\n\n"
                    "class MyWorker(KvCacheConnectorWorker):\n    pass\n")
    return path


# ---- 1. a TensorRT-LLM connector without --compat trtllm ----------------------------------------
def test_a_file_importing_tensorrt_llm_without_compat_is_told_to_add_it(tmp_path, no_trtllm):
    path = _trtllm_connector(tmp_path)
    target = f"{path}:MyScheduler:MyWorker"
    with pytest.raises(InputError) as caught:
        load_connector(target)
    assert str(caught.value) == (f"connector {target!r}: cannot import {path}: ModuleNotFoundError: "
                                 f"No module named 'tensorrt_llm'{HINT}")


def test_a_module_importing_a_tensorrt_llm_submodule_without_compat_is_told_to_add_it(tmp_path, no_trtllm,
                                                                                      monkeypatch):
    _trtllm_connector(tmp_path, "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "myconn_trt", raising=False)
    with pytest.raises(InputError) as caught:
        load_connector("myconn_trt:MyScheduler:MyWorker")
    assert str(caught.value) == ("connector 'myconn_trt:MyScheduler:MyWorker': cannot import myconn_trt: "
                                 f"ModuleNotFoundError: No module named 'tensorrt_llm'{HINT}")


def test_with_compat_given_a_module_it_lacks_gets_no_hint(tmp_path, no_trtllm):
    path = _trtllm_connector(tmp_path, "tensorrt_llm.not_provided")
    target = f"{path}:MyScheduler:MyWorker"
    with pytest.raises(InputError) as caught:
        load_connector(target, "trtllm")
    assert str(caught.value) == (f"connector {target!r}: cannot import {path}: ModuleNotFoundError: "
                                 "No module named 'tensorrt_llm.not_provided'; 'tensorrt_llm' is not a package")


def test_another_missing_module_gets_no_hint(tmp_path):
    path = tmp_path / "needs_vllm.py"
    path.write_text("import vllm_not_installed\n")
    with pytest.raises(InputError) as caught:
        load_connector(f"{path}:S:W")
    assert str(caught.value).endswith("ModuleNotFoundError: No module named 'vllm_not_installed'")


@pytest.mark.parametrize("command", [
    ["validate", "{target}"],                                     # the message comes from preflight's child
    ["bench", "--suite", "store", "--connector", "{target}", "--quick", "--output", "{out}"],
    ["trace", "run", SHIPPED, "--connector", "{target}"],
    ["trace", "sweep", SHIPPED, "--connector", "{target}", "--tokens-per-block", "16"],
], ids=["validate", "bench-store", "trace-run", "trace-sweep"])
def test_every_command_taking_a_connector_says_to_add_compat(command, tmp_path, no_trtllm):
    path = _trtllm_connector(tmp_path)
    target = f"{path}:MyScheduler:MyWorker"
    args = [a.format(target=target, out=tmp_path / "out") for a in command]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"kvtool: error: connector {target!r}: cannot import {path}: "
                                          f"ModuleNotFoundError: No module named 'tensorrt_llm'{HINT}"]


# ---- 2. an abstract method left out: the connector's class is named, not kvtool's line ------------
ABSTRACT = f'''import sys
sys.path.insert(0, {str(REPO / "examples")!r})
from dict_connector import DictConnectorScheduler, DictConnectorWorker
from kvtool.connector import KvCacheConnectorScheduler, KvCacheConnectorWorker


class PersistentKvCacheConnectorLeader(KvCacheConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, cache_block_ids):
        return False


def kept(cls):
    return cls


@kept
class HalfWorker(KvCacheConnectorWorker):
    def start_load_kv(self, stream):
        pass
'''


def _line_of(text: str) -> int:
    return ABSTRACT.splitlines().index(text) + 1


@pytest.fixture
def abstract_file(tmp_path) -> Path:
    path = tmp_path / "abstract_conn.py"
    path.write_text(ABSTRACT)
    return path


def _refusal(path: Path, target: str, cls: str, methods: str, line: int) -> str:
    return (f"kvtool: error: connector {target!r} could not be constructed: TypeError: Can't instantiate "
            f"abstract class {cls} with {methods} ({path}:{line})")


def _refused_lines(command: list[str], target: str) -> list[str]:
    """The stderr lines of `command` (with `{target}` filled in), which must exit 2."""
    result = runner.invoke(app, [a.format(target=target) for a in command])
    assert result.exit_code == 2, result.output
    return result.stderr.splitlines()


CONNECTOR_COMMANDS = pytest.mark.parametrize(
    "command", [["validate", "{target}"], ["trace", "run", SHIPPED, "--connector", "{target}"]],
    ids=["validate-preflight", "engine"])


@CONNECTOR_COMMANDS
def test_an_abstract_scheduler_names_its_class_statement(command, abstract_file):
    target = f"{abstract_file}:PersistentKvCacheConnectorLeader:DictConnectorWorker"
    assert _refused_lines(command, target) == [_refusal(
        abstract_file, target, "PersistentKvCacheConnectorLeader", "abstract method update_state_after_alloc",
        _line_of("class PersistentKvCacheConnectorLeader(KvCacheConnectorScheduler):"))]


@CONNECTOR_COMMANDS
def test_an_abstract_worker_names_its_class_statement_past_its_decorator(command, abstract_file):
    target = f"{abstract_file}:DictConnectorScheduler:HalfWorker"
    methods = "abstract methods get_finished, register_kv_caches, save_kv_layer, wait_for_layer_load, wait_for_save"
    assert _refused_lines(command, target) == [_refusal(abstract_file, target, "HalfWorker", methods,
                                                        _line_of("class HalfWorker(KvCacheConnectorWorker):"))]


def test_other_construction_errors_are_described_as_before():
    from kvtool.connector.raised import describe_construction_error

    class Plain:
        def __init__(self, llm_args):
            raise TypeError("bad llm_args")
    try:
        Plain(None)
    except TypeError as exc:
        described = describe_construction_error(exc, Plain)
    assert described == f"TypeError: bad llm_args ({__file__}:{Plain.__init__.__code__.co_firstlineno + 1})"


# ---- 3. local-prefix says which of its sub-cases it exercised, and why not -----------------------
def test_local_prefix_says_which_sub_case_was_exercised_and_why_the_other_was_not():
    result = runner.invoke(app, ["validate", f"{EXAMPLE}:DictConnectorScheduler:DictConnectorWorker",
                                 "--scenario", "local-prefix", "--model", "tiny", "--runtime", "trtllm-v2-release",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["check"]: r for r in json.loads(result.stdout)["results"] if r["scenario"] == "local-prefix"}
    assert {check: r["verdict"] for check, r in rows.items()} == {"integrity": "pass", "warm-hit": "miss"}
    assert rows["integrity"]["evidence"][-2:] == [
        "exercised: a local match on a block boundary, more delivered (request 5: asked with 8 tokens matched "
        "locally, 23 tokens delivered)",   # it offers all but the last token itself
        "not exercised: a local match inside a block, more delivered (the connector offered nothing past the "
        "local match; request 6: asked with 13 tokens matched locally, 0 tokens delivered)"]


# ---- 4. model names ------------------------------------------------------------------------------
PRESET_LIST = ("tiny, tiny-vswa, llama-3.1-8b, llama-3.1-70b, qwen3-8b, mistral-7b, gemma-3-27b, gpt-oss-20b, "
               "deepseek-v3")


@pytest.mark.parametrize("typed, meant", [("llama3-8b", "llama-3.1-8b"), ("Llama-3.1-8B", "llama-3.1-8b"),
                                          ("Qwen3-8B", "qwen3-8b"), ("gemma3-27b", "gemma-3-27b")])
def test_a_mistyped_model_gets_a_suggestion(typed, meant):
    with pytest.raises(InputError) as caught:
        load_model(typed)
    assert str(caught.value) == (f"unknown model {typed!r} (did you mean {meant!r}?): not a preset ({PRESET_LIST}) "
                                 "and not a config.json path")


def test_a_model_nothing_like_a_preset_gets_no_suggestion():
    with pytest.raises(InputError) as caught:
        load_model("zzz")
    assert str(caught.value) == f"unknown model 'zzz': not a preset ({PRESET_LIST}) and not a config.json path"


@pytest.mark.parametrize("command", [["inspect-layout"], ["validate", "host"], ["trace", "run", SHIPPED],
                                     ["bench", "--quick"]])
def test_every_command_suggests_the_model(command):
    result = runner.invoke(app, [*command, "--model", "llama3-8b"])
    assert result.exit_code == 2
    assert "unknown model 'llama3-8b' (did you mean 'llama-3.1-8b'?): not a preset" in result.stderr


def _config(path: Path, **extra) -> Path:
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "hidden_size": 256, **extra}))
    return path


def test_a_config_file_named_by_its_key_says_which_key_in_one_plain_line(tmp_path):
    path = _config(tmp_path / "config.json", model_type="mistral")
    result = runner.invoke(app, ["inspect-layout", "--model", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [f"kvtool: model 'mistral' (the model_type of {path})"]


def test_a_config_file_named_after_itself_prints_no_model_line(tmp_path):
    path = _config(tmp_path / "okcfg.json")
    result = runner.invoke(app, ["inspect-layout", "--model", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == str(path) and result.stderr == ""


# ---- 5. the stream the worker hooks get ----------------------------------------------------------
@pytest.mark.parametrize("hook", ["start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"])
def test_the_worker_hooks_stream_is_typed_as_a_cuda_stream_or_a_host_stream(hook):
    import torch

    from kvtool.connector import HostStream
    hints = typing.get_type_hints(getattr(KvCacheConnectorWorker, hook), {"torch": torch, "HostStream": HostStream})
    assert hints["stream"] == torch.cuda.Stream | HostStream


def test_every_stream_taking_hook_of_a_cpu_run_gets_a_host_stream_never_none():
    """What the worker's docstring promises, as a run delivers it: on host pages every hook that
    takes a stream receives a HostStream (on GPU pages tests/gpu checks the torch.cuda.Stream)."""
    from kvtool.connector import HostStream
    mc = mock_connector(echo_finished=True)
    engine = make_engine(mc.spec)
    engine.add_request(Request(0, list(range(10)), max_new_tokens=2))
    engine.run()
    hooks = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")
    streams = {hook: [c.args[-1] for c in getattr(mc.worker, hook).call_args_list] for hook in hooks}
    assert all(streams[hook] for hook in hooks), {hook: len(s) for hook, s in streams.items()}
    assert {type(stream) for calls in streams.values() for stream in calls} == {HostStream}


def test_a_cpu_run_hands_the_hooks_the_documented_host_stream():
    import torch

    from kvtool.connector import HostStream
    stream = forward_stream(torch.device("cpu"))
    assert type(stream) is HostStream and stream.query() and stream.record_event("e") == "e"
