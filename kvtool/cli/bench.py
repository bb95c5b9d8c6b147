"""`kvtool bench`: connector transfers against the physical link, or the manager's own cost."""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Set as AbstractSet
from enum import Enum
from pathlib import Path
from typing import Annotated

import pandas as pd
import torch
import typer
from rich.console import Console

from kvtool.bench import compute, manager_suite, protocol_compute, protocol_suite
from kvtool.bench.overlap import OVERLAPPING_MODES, connector_mode, overlap_rows
from kvtool.bench.protocol_engine import scratch_working_folder
from kvtool.bench.store_suite import run_store_suite
from kvtool.bench.sweep import CPU_DEFAULT, GPU_DEFAULT, QUICK, SweepChoice, SweepDefaults, plan
from kvtool.bench.transfer_suite import TransferSuite
from kvtool.bench.workspace import DIRECTIONS, GRANULARITIES, Direction, geometry
from kvtool.cli.common import ExitCode, clean_errors, fail, pages_device, print_connector_help, progress_bar
from kvtool.connector.compat import install_compat
from kvtool.connectors.registry import BUILTIN_CONNECTORS, load_connector
from kvtool.engine.runtimes import DEFAULT_RUNTIME, RUNTIMES, RuntimeName, runtime_name
from kvtool.engine.runtimes.names import VLLM_RUNTIME
from kvtool.errors import InputError, KvToolError
from kvtool.inputs import connector_options, parse_options
from kvtool.models import load_model
from kvtool.report.bench_report import bench_notes, column_legend, default_output_dir, rows_tables, write_run
from kvtool.report.fit_table import report_width
from kvtool.report.overlap_plot import plot_overlap
from kvtool.report.run_folder import prepare_run_folder
from kvtool.transfer import available_backends
from kvtool.transfer.registry import backend_names
from kvtool.units import parse_size
from kvtool.vllm_compat.entry import VLLM_COMPAT, run_vllm_store
from kvtool.vllm_compat.install import VLLM_VERSION


def _sweep_models() -> str:
    def listed(sweep: SweepDefaults) -> str:
        return ", ".join(f"{m} (tpb {'/'.join(map(str, t))})" for m, t in sweep["models"].items())
    return f"on a GPU {listed(GPU_DEFAULT)}; on a CPU {listed(CPU_DEFAULT)}; --quick {listed(QUICK)}"


class Suite(str, Enum):
    transfer = "transfer"
    manager = "manager"
    store = "store"


class Format(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def _check_choices(values: list[str], allowed: tuple[str, ...] | list[str], what: str) -> tuple[str, ...]:
    for value in values:
        if value not in allowed:
            raise InputError(f"unknown {what} {value!r}; choose from {', '.join(allowed)}")
    return tuple(dict.fromkeys(values))


@clean_errors
def bench(
    model: Annotated[list[str], typer.Option(metavar="NAME",
                                             help=f"Model preset (repeatable) [default: {_sweep_models()}].")] = [],
    tokens_per_block: Annotated[list[int], typer.Option(metavar="N", help="Tokens per block (repeatable) [default: "
                                                        "per model, as listed for --model].")] = [],
    granularity: Annotated[list[str], typer.Option(metavar="slot|layer", help="slot (whole pages) or layer (one "
                                                   "layer's buffers) (repeatable) [default: both].")] = [],
    direction: Annotated[list[str], typer.Option(metavar="save|load|both|gather",
                                                 help="Repeatable [default: all four].")] = [],
    backend: Annotated[list[str], typer.Option(metavar="NAME", help=f"Transfer backend: {', '.join(backend_names())} "
                                               "(repeatable) [default: every one that runs here].")] = [],
    batch_bytes: Annotated[str | None, typer.Option(metavar="SIZE", help="Bytes per batch, e.g. 64MiB [default: 64MiB "
                                                       "on a GPU, 16MiB on a CPU or with --quick].")] = None,
    repeats: Annotated[int | None, typer.Option(metavar="N", help="Timed repeats per case, median reported [default: "
                                                   f"{GPU_DEFAULT['repeats']} on a GPU, "
                                                   f"{CPU_DEFAULT['repeats']} on a CPU, "
                                                   f"{QUICK['repeats']} with --quick]; a connector through the "
                                                   "engine: rounds per block size, each a fresh engine [default: 3, "
                                                   "1 with --quick].")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A small sweep, for a smoke test.")] = False,
    format: Annotated[Format, typer.Option("--format", help="What to print: table, json or csv.")] = Format.table,
    output: Annotated[Path | None, typer.Option(metavar="DIR", help="Run folder: meta.json, results.csv, results.json, "
                                                   "the plot [default: results/<UTC timestamp>/].")] = None,
    suite: Annotated[Suite | None, typer.Option(help="transfer (the link), manager (CPU cost per block) or "
                                                   "store (a connector's save/load paths) [default: store when "
                                                   "--connector is given, else transfer].")] = None,
    connector: Annotated[str | None, typer.Option(help="--suite store: host, disk, redis, mooncake, or any "
                                                     "connector as MODULE:SCHED:WORKER or path/to/file.py:SCHED:WORKER "
                                                     "(measured through the engine, in a temporary working folder "
                                                     "removed afterwards: a cold then a warm round) "
                                                     "[default: host].")] = None,
    compat: Annotated[str | None, typer.Option(help="--suite store: trtllm: provide TensorRT-LLM's connector "
                                                  "modules to a connector written against them; vllm: --connector "
                                                  "is a vLLM connector, driven through vLLM's own scheduler "
                                                  "(docs/vllm-compat.md).")] = None,
    connector_opt: Annotated[list[str], typer.Option(help="--suite store: KEY=VALUE for the connector "
                                                     "(repeatable).")] = [],
    connector_help: Annotated[bool, typer.Option("--connector-help", help="--suite store: list --connector's "
                                                 "options (what --connector-opt takes), then exit.")] = False,
    with_compute: Annotated[bool, typer.Option("--with-compute", help="Also measure a matmul's slowdown while "
                                               "saving: transfer suite, GPU only, per backend against one contiguous "
                                               "copy; store suite, any connector through the engine, on a GPU or a "
                                               "CPU.")] = False,
    plot: Annotated[bool, typer.Option("--plot", help="--suite store --with-compute: also write overlap.png, the "
                                       "link share and the compute slowdown against block size.")] = False,
    device: Annotated[str | None, typer.Option(metavar="cpu|cuda", help="--suite store: where the KV pages live; "
                                                  "on cuda every connector is driven through the engine and measured "
                                                  "against the PCIe link [default: cpu].")] = None,
    runtime: Annotated[str | None, typer.Option(metavar="NAME", help="--suite store: the TensorRT-LLM runtime "
                                                   "the engine plays (" + ", ".join(map(str, RUNTIMES)) + "); "
                                                   "given, the built-in stores too are driven through the engine "
                                                   f"[default: {DEFAULT_RUNTIME}].")] = None,
) -> None:
    """Measure connector transfers (save, load, both at once, GPU gather) per backend against the
    link peak measured in the same run; the manager's cost with --suite manager; or a connector's
    own save and load paths against a raw loop of its store with --suite store --connector NAME (a
    connector of your own: its hooks timed through the engine, a cold then a warm round).
    Writes meta.json, results.csv, results.json and (transfer) a plot under --output."""
    suite = _chosen_suite(suite, {"--connector": connector is not None, "--compat": compat is not None,
                                  "--connector-opt": bool(connector_opt), "--device": device is not None,
                                  "--plot": plot,
                                  "--runtime": runtime is not None},
                          {"--granularity": bool(granularity), "--direction": bool(direction),
                           "--backend": bool(backend)})
    connector = connector or "host"
    if compat == VLLM_COMPAT and connector_help:
        raise InputError("--connector-help lists kvtool connectors' options; a vLLM connector takes its "
                         "kv_connector_extra_config as --connector-opt KEY=VALUE")
    if connector_help:
        print_connector_help(load_connector(connector, compat))
        return
    out_dir = prepare_run_folder((output or default_output_dir()).resolve(), "bench")
    console = Console(stderr=True)
    if suite is Suite.manager:
        rows = [r.as_dict() for r in manager_suite.run()]
        write_run(out_dir, rows, {}, "manager")
        _print(rows, format, "manager cost per block (µs) at 1x, 10x, 100x cached blocks")
        console.print(f"results in {out_dir}", highlight=False, soft_wrap=True)
        return
    if suite is Suite.store:
        if plot and not with_compute:
            raise InputError("--plot draws the link share beside the compute slowdown: add --with-compute")
        _store_suite(connector, connector_opt, compat, model, tokens_per_block, batch_bytes, repeats, quick, out_dir,
                     format, pages_device(device, "cpu"), with_compute, runtime_name(runtime) if runtime else None,
                     plot)
        return
    cuda = torch.cuda.is_available()
    if with_compute and not cuda:
        raise InputError("--with-compute needs a CUDA GPU")
    if repeats is not None and repeats <= 0:
        raise InputError(f"--repeats must be positive, got {repeats}")
    for tpb in tokens_per_block:
        if tpb <= 0:
            raise InputError(f"tokens per block must be positive, got {tpb}")
    for name in model:
        load_model(name)
    available = available_backends()   # probing instantiates each CUDA backend: once
    backends = _check_choices(backend, backend_names(), "backend") if backend else tuple(available)
    missing = [b for b in backends if b not in available]
    if missing:
        raise InputError(f"backend(s) {', '.join(missing)} cannot run here (available: {', '.join(available)})")
    choice = SweepChoice(tuple(model) or None, tuple(tokens_per_block) or None,
                         _check_choices(granularity, GRANULARITIES, "granularity") or GRANULARITIES,
                         tuple(map(Direction, _check_choices(direction, DIRECTIONS, "direction"))) or DIRECTIONS,
                         backends,
                         parse_size(batch_bytes) if batch_bytes else None, repeats, quick)
    cases, num_repeats = plan(choice, cuda)
    for case in {(c.model, c.tokens_per_block, c.granularity) for c in cases}:
        geometry(*case)
    transfer = TransferSuite(torch.device("cuda" if cuda else "cpu"), num_repeats)
    rows = _run_cases(transfer, cases, console)
    extra = {"compute": _compute_rows(transfer, cases, backends, console)} if with_compute else {}
    section = write_run(out_dir, rows, extra, "transfer")
    _print(rows, format, f"kvtool bench · {section.get('name')} · GB/s (median of {num_repeats})")
    if extra.get("compute"):
        _print(extra["compute"], format, "with a bf16 matmul running")
    if format is Format.table:
        skipped = [b for b in backend_names() if b not in available]
        for note in bench_notes(rows, section.get("kind", "cpu"), skipped):
            Console(width=max(150, Console().width)).print(f"note: {note}", highlight=False, markup=False)
    console.print(f"results in {out_dir}", highlight=False, soft_wrap=True)
    if not all(r["verified"] for r in rows):
        raise fail("some transfers moved wrong bytes (verified = NO)", ExitCode.CHECK_FAILED)


def _chosen_suite(suite: Suite | None, store_options: dict[str, bool], transfer_options: dict[str, bool]
                  ) -> Suite:
    """The suite asked for, or the one the options given belong to; InputError for an option the
    suite would ignore (a connector named on the transfer suite measured nothing of it)."""
    store = [name for name, given in store_options.items() if given]
    chosen = suite or (Suite.store if store else Suite.transfer)
    strays = store if chosen is not Suite.store else []
    strays += [name for name, given in transfer_options.items() if given and chosen is not Suite.transfer]
    if strays:
        owner = "--suite store (a connector's own paths)" if chosen is not Suite.store else "--suite transfer"
        raise InputError(f"{', '.join(strays)} {'applies' if len(strays) == 1 else 'apply'} to {owner}, "
                         f"not to --suite {chosen.value}")
    return chosen


STORE_TOKENS_PER_BLOCK = (16, 32, 64, 128)


def _store_suite(connector: str, connector_opt: list[str], compat: str | None, model: list[str],
                 tokens_per_block: list[int], batch_bytes: str | None, repeats: int | None, quick: bool,
                 out_dir: Path, format: Format, device: str = "cpu", with_compute: bool = False,
                 runtime: RuntimeName | None = None, plot: bool = False) -> None:
    """The store suite: the built-in stores against raw loops of their store on a CPU, any other
    connector (or on cuda, or with --with-compute or --runtime) through the engine."""
    if len(model) > 1:
        raise InputError("--suite store measures one --model at a time")
    name = model[0] if model else "llama-3.1-8b"
    load_model(name)
    if any(t <= 0 for t in tokens_per_block):
        raise InputError(f"tokens per block must be positive, got {tuple(tokens_per_block)}")
    if repeats is not None and repeats <= 0:
        raise InputError(f"--repeats must be positive, got {repeats}")
    if compat == VLLM_COMPAT:
        if device == "cuda" or with_compute or runtime is not None or batch_bytes is not None:
            raise InputError("--compat vllm measures on CPU pages (vLLM's CPU build), without --with-compute, "
                             "--runtime or --batch-bytes")
        _vllm_store_suite(connector, connector_opt, name, tokens_per_block, repeats, quick, out_dir, format)
        return
    install_compat(compat, (VLLM_COMPAT,))
    spec = load_connector(connector, compat)
    options = connector_options(spec, connector_opt)
    if spec.name not in BUILTIN_CONNECTORS or device == "cuda" or with_compute or runtime is not None:
        if batch_bytes is not None:
            raise InputError("--batch-bytes sizes the built-in stores' batches on a CPU; a run through the engine "
                             "moves whole prompts")
        _protocol_suite(spec, options, name, tokens_per_block, repeats, quick, out_dir, format, device, with_compute,
                        runtime or DEFAULT_RUNTIME, plot)
        return
    sizes = tuple(tokens_per_block) or ((32,) if quick else STORE_TOKENS_PER_BLOCK)
    batch = parse_size(batch_bytes) if batch_bytes else (16 << 20 if quick else 64 << 20)
    with tempfile.TemporaryDirectory(prefix="kvtool-bench-store-") as scratch:
        if connector == "disk" and "dir" not in options:
            options["dir"] = str(Path(scratch) / "disk-store")
        rows = [r.as_dict() for r in run_store_suite(spec, options, name, list(sizes), batch,
                                                       repeats or (3 if quick else 5), Path(scratch))]
    write_run(out_dir, rows, {}, "store")
    _print(rows, format, f"kvtool bench --suite store · {connector} · GB/s against a raw loop of the same bytes")
    Console(stderr=True).print(f"results in {out_dir}", highlight=False, soft_wrap=True)
    if not all(r["verified"] for r in rows):
        raise fail("the store gave back other bytes than it saved (verified = NO)", ExitCode.CHECK_FAILED)


def _vllm_store_suite(connector: str, connector_opt: list[str], model: str, tokens_per_block: list[int],
                      repeats: int | None, quick: bool, out_dir: Path, format: Format) -> None:
    """The store suite for a vLLM connector (`kvtool.vllm_compat.store_bench`), beside kvtool's
    reference connector through kvtool's engine in the same run; exit 1 naming the failed check."""
    sizes = list(tokens_per_block) or list(protocol_suite.QUICK_TOKENS_PER_BLOCK if quick else
                                            protocol_suite.TOKENS_PER_BLOCK)
    workload = protocol_suite.QUICK if quick else protocol_suite.Workload()
    with scratch_working_folder():
        rows, problems = run_vllm_store(connector, parse_options(connector_opt), model, sizes, workload,
                                        repeats or (3 if quick else 5), repeats or (1 if quick else 3),
                                        protocol_suite.reference_connector("cpu"))
    write_run(out_dir, [{**r.as_dict(), "runtime": VLLM_RUNTIME} for r in rows], {}, "store")
    _print([r.as_dict() for r in rows], format, f"kvtool bench --suite store · {connector} · through vLLM "
           f"{VLLM_VERSION}'s scheduler: {workload.prompts} prompts x {workload.blocks} blocks, cold then warm · "
           "GB/s against a contiguous copy and kvtool's host connector")
    Console(stderr=True).print(f"results in {out_dir}", highlight=False, soft_wrap=True)
    if problems:
        raise fail("; ".join(problems), ExitCode.CHECK_FAILED)


def _protocol_suite(spec, options: dict[str, str], model: str, tokens_per_block: list[int], repeats: int | None,
                    quick: bool, out_dir: Path, format: Format, device: str = "cpu", with_compute: bool = False,
                    runtime: RuntimeName = DEFAULT_RUNTIME, plot: bool = False) -> None:
    """`protocol_suite` on a connector the store suite does not know (or on GPU pages, or with
    products beside the saves), beside kvtool's reference connector; exit 1 naming the failed check."""
    sizes = list(tokens_per_block) or list(protocol_suite.QUICK_TOKENS_PER_BLOCK if quick else
                                            protocol_suite.TOKENS_PER_BLOCK)
    workload = protocol_suite.QUICK if quick else protocol_suite.Workload()
    reference = protocol_suite.reference_connector(device)
    with scratch_working_folder():
        measured, problems = protocol_suite.run_protocol_suite(spec, options, model, sizes, workload,
                                                               repeats or (3 if quick else 5), device, reference,
                                                               rounds=repeats or (1 if quick else 3), runtime=runtime)
        rows = [{**r.as_dict(), "runtime": str(runtime)} for r in measured]
        extra: dict = {}
        if with_compute:
            compute_rows: list = []
            try:
                problems += _protocol_compute_rows(spec, options, reference, model, sizes, workload, device,
                                                   compute_rows, runtime)
            except KvToolError as exc:         # the rows measured so far are written all the same
                problems.append(f"with compute: {exc}")
            if compute_rows:
                extra["compute"] = [r.as_dict() for r in compute_rows]
                modes = {protocol_suite.connector_label(spec.name): connector_mode(spec, options),
                         protocol_suite.reference_label(reference): connector_mode(*reference)}
                extra["overlap"] = [r.as_dict() for r in overlap_rows(rows, extra["compute"], modes)]
    device_section = write_run(out_dir, rows, extra, "store")
    if plot and extra.get("overlap"):
        plot_overlap(extra["overlap"], out_dir / "overlap.png", device_section.get("name", device))
    _print(rows, format, f"kvtool bench --suite store · {rows[0]['connector']} · through the engine ({runtime}): "
                         f"{workload.prompts} prompts x {workload.blocks} blocks, cold then warm · GB/s against "
                         f"{'the PCIe link' if device == 'cuda' else 'a contiguous copy'} and kvtool's host connector")
    if extra.get("compute"):
        compute = extra["compute"]
        nothing_dropped = {"products_dropped"} if not any(r["products_dropped"] for r in compute) else set()
        _print(compute, format, f"saves beside {compute[0]['products']}: each product's time alone, during the "
                                "connector's saves, and beside the engine's own work", {"products"} | nothing_dropped)
    if extra.get("overlap"):
        _print(extra["overlap"], format, "link share and compute slowdown side by side (overlapping modes: "
                                         + ", ".join(OVERLAPPING_MODES) + ")")
    Console(stderr=True).print(f"results in {out_dir}", highlight=False, soft_wrap=True)
    if problems:
        raise fail("; ".join(problems), ExitCode.CHECK_FAILED)


def _protocol_compute_rows(spec, options: dict[str, str], reference, model: str, sizes: list[int], workload,
                           device: str, rows: list, runtime: RuntimeName = DEFAULT_RUNTIME) -> list[str]:
    """The loaded cold rounds of the connector and of the reference, appended to `rows` as measured."""
    targets = [(spec, options, protocol_suite.connector_label(spec.name)),
               (reference[0], reference[1], protocol_suite.reference_label(reference))]
    return protocol_compute.run_compute_suite(targets, model, sizes, workload, device, rows, runtime)


def _run_cases(transfer: TransferSuite, cases, console: Console) -> list[dict]:
    rows: list[dict] = []
    with progress_bar("bench", len(cases), console) as update:
        for i, case in enumerate(cases):
            label = f"{case.backend} {case.direction} {case.model}/{case.tokens_per_block} {case.granularity}"
            update(info=label)
            rows.append(transfer.measure(case).as_dict())
            update(advance=1)
            if not console.is_terminal:     # a CI log gets a line per case instead of a bar
                console.print(f"bench {i + 1}/{len(cases)}: {label}: {rows[-1]['gbps']} GB/s", highlight=False)
    return rows


def _compute_rows(transfer: TransferSuite, cases, backends, console: Console) -> list[dict]:
    """Per shape (the first two), the floor first, then every variant of the chosen backends."""
    rows = []
    shapes = list(dict.fromkeys((c.model, c.tokens_per_block, c.granularity, c.batch_bytes) for c in cases))[:2]
    variants = [v for v in compute.VARIANTS if v.backend in backends]
    for model, tpb, gran, batch in shapes:
        ws = transfer.workspace(geometry(model, tpb, gran), batch)
        peak = transfer.peak(ws, Direction.SAVE)
        console.print(f"with compute: {compute.FLOOR_VARIANT.label} {model}/{tpb} {gran}")
        floor = compute.measure(compute.FLOOR_VARIANT, model, tpb, gran, batch, peak)
        rows.append(floor.as_dict())
        for variant in variants:
            console.print(f"with compute: {variant.label} {model}/{tpb} {gran}")
            rows.append(compute.measure(variant, model, tpb, gran, batch, peak, floor.matmul_slowdown).as_dict())
    return rows


def _print(rows: list[dict], format: Format, title: str, table_omits: AbstractSet[str] = frozenset()) -> None:
    """`rows` as json, csv (every key) or a table (without `table_omits`, said in the title)."""
    if format is Format.json:
        print(json.dumps(rows, indent=2))
    elif format is Format.csv:
        buffer = io.StringIO()
        pd.DataFrame(rows).to_csv(buffer, index=False)
        print(buffer.getvalue(), end="")
    else:
        shown = [{k: v for k, v in row.items() if k not in table_omits} for row in rows]
        width = report_width(150)
        console = Console(width=width)
        for table in rows_tables(shown, title, width):
            console.print(table)
        if shown:
            console.print(f"columns: {column_legend(list(shown[0]))}", highlight=False, markup=False)
