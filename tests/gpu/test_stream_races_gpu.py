"""On GPU pages (`--device cuda`), the streams lose every race they can (`engine.stream_races`):
a save on a stream of its own that does not wait for the hook's stream, and a load on one that
the hook's stream is not made to wait for, fail `integrity` every run at the default seed, with
evidence naming stream order; the host connector (ordered by its transfer backend) and the
late-reader's correct twins pass, and the late reader fails on device pages too. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvtool.connectors.registry import load_connector
from kvtool.engine.runtimes import RuntimeName
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_scenario

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

STREAMS = "tests/helpers/stream_connectors.py"
LATE = "tests/helpers/late_connectors.py"
STREAM_ORDER = "so stream order decides"


def _integrity(target: str, scenario: str = "cold-warm", model: str = "tiny"):
    results = run_scenario(scenario, Context(load_connector(target), model, device="cuda",
                                             runtime=RuntimeName("trtllm-v2-release")))
    (integrity,) = [r for r in results if r.check == "integrity"]
    return integrity, results


@pytest.mark.parametrize("planted", ["SideStreamSaves:SideStreamSavesWorker", "SideStreamLoads:SideStreamLoadsWorker"])
def test_a_copy_not_ordered_against_the_hooks_stream_fails_every_run_naming_stream_order(planted):
    for _ in range(5):
        integrity, _ = _integrity(f"{STREAMS}:{planted}")
        assert integrity.failed, integrity.evidence[:3]
        assert STREAM_ORDER in integrity.evidence[0], integrity.evidence[:3]


@pytest.mark.parametrize("target", ["host", "host-async", "host-layerwise",
                                    "examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker",
                                    f"{LATE}:SlowPoolAsync:SlowPoolAsyncWorker"])
@pytest.mark.parametrize("scenario", ["cold-warm", "async-save"])
def test_correct_connectors_pass_with_the_streams_losing(target, scenario):
    integrity, results = _integrity(target, scenario)
    assert [(r.check, r.evidence[:2]) for r in results if r.failed] == []


def test_the_late_reader_fails_on_device_pages_too():
    integrity, _ = _integrity(f"{LATE}:LateReader:LateReaderWorker", "local-prefix")
    assert integrity.failed
    assert "the background work start_load_kv started for it" in integrity.evidence[0], integrity.evidence[:2]
