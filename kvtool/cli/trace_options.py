"""The options every replay command takes (`trace run`, `trace sweep`), declared once.

`with_replay_options` adds them to a command's own options and hands the command one
`ReplayOptions` (`options=`) instead, so the two commands cannot drift apart in names, defaults
or help.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from kvtool.engine.runtimes import DEFAULT_RUNTIME, RUNTIMES
from kvtool.trace.gpus import DEFAULT_GPU, GPUS
from kvtool.trace.setup import ReplayOptions
from kvtool.workloads.source import FORMATS


def _shared(
    workload: Annotated[Path, typer.Argument(help="Workload: kvtool JSON Lines, or a Mooncake or Bailian trace "
                                             "(workloads/README.md).")],
    trace_format: Annotated[str | None, typer.Option(metavar="NAME", help=f"{'|'.join(FORMATS)} "
                                                        "[default: detected from the first line].")] = None,
    source_block_size: Annotated[int | None, typer.Option(metavar="N", help="Tokens behind one hash id "
                                                             "[default: 512 mooncake, 16 bailian].")] = None,
    prefill_only: Annotated[bool, typer.Option("--prefill-only", help="Generate nothing: every output "
                                               "length 0.")] = False,
    fidelity: Annotated[str | None, typer.Option(metavar="bytes|blocks", help="bytes: KV bytes written and "
                                                    "verified; blocks: virtual pools, no bytes (the tier: "
                                                    "--connector index) [default: blocks for traces, bytes for "
                                                    "kvtool].")] = None,
    model: Annotated[str | None, typer.Option(help="Preset name or path to a Hugging Face config.json "
                                                 "[default: tiny; llama-3.1-8b for traces].")] = None,
    num_slots: Annotated[int | None, typer.Option(metavar="N", help="Slots per pool group [default: what the "
                                                     "model leaves on the --gpu for traces or with --gpu; 1024 "
                                                     "for kvtool workloads].")] = None,
    gpu_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="Memory for all pools of a GPU (the "
                                                      "GPU pool) instead of --num-slots or the one derived from "
                                                      "the model: GPU memory - weights / tp - 10 %.")] = None,
    max_batch_size: Annotated[int, typer.Option(help="Requests per iteration at most.")] = 64,
    max_num_tokens: Annotated[int, typer.Option(help="Tokens per iteration at most (the token budget).")] = 8192,
    chunk_size: Annotated[int | None, typer.Option(metavar="N", help="Prefill chunk size [default: the token "
                                                      "budget only].")] = None,
    connector_opt: Annotated[list[str], typer.Option(help="KEY=VALUE option for the connector (repeatable).")] = [],
    compat: Annotated[str | None, typer.Option(metavar="trtllm", help="Provide TensorRT-LLM's connector "
                                                  "modules to a --connector written against them.")] = None,
    no_local_reuse: Annotated[bool, typer.Option("--no-local-reuse", help="Never reuse the local radix tree.")] = False,
    admission: Annotated[str, typer.Option(metavar="reserve|greedy|max-utilization", help="reserve: admit a "
                                           "request only when every running one can still grow to its full output "
                                           "(TensorRT-LLM's GUARANTEED_NO_EVICT); greedy: whenever its first chunk "
                                           "fits; max-utilization: greedy, and a running request that cannot grow "
                                           "pauses the one started last, which runs again from the start "
                                           "(TensorRT-LLM's MAX_UTILIZATION).")]
    = "reserve",
    runtime: Annotated[str, typer.Option(metavar="NAME", help="The TensorRT-LLM runtime the engine plays: "
                                         + ", ".join(map(str, RUNTIMES)) + " (when a request is asked, which "
                                         "pages its first chunk takes; see docs/trtllm-compat.md).")]
    = str(DEFAULT_RUNTIME),
    seed: Annotated[int, typer.Option(help="Seed of the KV fingerprints.")] = 0,
    cost_model: Annotated[bool | None, typer.Option("--cost-model/--no-cost-model", help="Clock the replay "
                                                       "with the GPU cost model and report TTFT [default: on for "
                                                       "traces; off: 10 ms an iteration].")] = None,
    gpu: Annotated[str | None, typer.Option(metavar="|".join(GPUS), help="The GPU of the cost model and of the "
                                               "GPU pool derived from the model (its memory less the weights a "
                                               f"GPU holds and 10 % for activations) [default: {DEFAULT_GPU}; the "
                                               "pool only for traces unless given].")] = None,
    tflops: Annotated[float | None, typer.Option(help="Compute rate of one GPU, TFLOP/s [default: the --gpu's, "
                                                    "750 for the H200 (measured bf16)].")] = None,
    hbm_gbps: Annotated[float | None, typer.Option(help="HBM read rate of one GPU, GB/s: a decode step reads "
                                                      "the weights and its context's KV at it [default: the "
                                                      "--gpu's, 3888 for the H200].")] = None,
    load_gbps: Annotated[float | None, typer.Option(help="Connector load rate of one GPU, GB/s [default: the "
                                                       "--gpu's, 51].")] = None,
    remote_gbps: Annotated[float | None, typer.Option(help="Load rate of a shared remote tier below the host "
                                                         "tier (stacked tiers), GB/s a GPU [default: 25, a "
                                                         "200 Gb/s NIC].")] = None,
    bandwidth_from: Annotated[Path | None, typer.Option(metavar="DIR", help="Take the load rate from a "
                                                           "kvtool bench run folder (results.json), at the "
                                                           "replay's tokens per block (or the closest), and "
                                                           "turn the cost model on.")] = None,
    params: Annotated[float | None, typer.Option(help="Active parameters [default: the preset's].")] = None,
    attention_width: Annotated[int | None, typer.Option(help="Query heads x head size [default: the "
                                                           "preset's].")] = None,
    draft_tokens: Annotated[int, typer.Option(metavar="K", help="Draft tokens per decode step (speculative "
                                              "decoding: a verify pass of 1 + K tokens; 0: off).")] = 0,
    acceptance: Annotated[float, typer.Option(metavar="P", help="With --draft-tokens: the probability a draft is "
                                              "accepted given the ones before it were (seeded).")] = 0.7,
) -> None:
    """Only its signature is used: the shared options, in the order `--help` lists them."""


ConnectorHelp = Annotated[bool, typer.Option("--connector-help", help="List the connector's options (what "
                                             "--connector-opt takes), then exit; WORKLOAD may be left out.")]
"""`--connector-help` of a replay command; the command is registered with `cls=ConnectorHelpCommand`."""


def _keyword_parameters(function: Callable) -> list[inspect.Parameter]:
    """Its parameters with their annotations evaluated (typer reads a given signature as it is)."""
    return [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(function, eval_str=True).parameters.values()]


_SHARED = _keyword_parameters(_shared)


def with_replay_options(command: Callable) -> Callable:
    """`command` with the shared replay options added; it is called with `options=ReplayOptions(...)`
    in their place (`connector_opt` as a tuple) and its own options as given."""
    own = [p for p in _keyword_parameters(command) if p.name != "options"]
    names = [p.name for p in _SHARED]

    @functools.wraps(command)
    def wrapper(**kwargs):
        shared = {name: kwargs.pop(name) for name in names}
        shared["connector_opt"] = tuple(shared["connector_opt"])
        return command(options=ReplayOptions(**shared), **kwargs)

    parameters = _SHARED[:1] + own + _SHARED[1:]
    wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper
