"""`kvtool validate`: drive a connector through the protocol's hard cases and judge it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import pandas as pd
import torch
import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli.common import (
    CONNECTOR_CHOICES,
    FORMAT_HELP,
    OUTPUT_HELP,
    ExitCode,
    OutputFormat,
    clean_errors,
    deprecated,
    fail,
    frame_text,
    pages_device,
    print_connector_help,
    say,
    suggest,
)
from kvtool.connector.compat import install_compat
from kvtool.connectors.registry import load_connector
from kvtool.engine.runtimes import RUNTIMES, runtime_name
from kvtool.errors import InputError
from kvtool.inputs import connector_options, note_model_origin, parse_options, warn
from kvtool.models import PRESETS, load_model, shard_model
from kvtool.report.fit_table import report_width
from kvtool.report.run_folder import check_writable_file, prepare_run_folder, write_file, write_meta
from kvtool.validate.explore import Finding, SeedsRun, explore, reproduce_command
from kvtool.validate.harness import Context
from kvtool.validate.junit import junit_xml
from kvtool.validate.preflight import preflight
from kvtool.validate.remote_scenarios import NEEDS_REMOTE, REMOTE_SCENARIOS
from kvtool.validate.remote_servers import remote_control
from kvtool.validate.results import CHECKS, CheckResult, Verdict, summary_line
from kvtool.validate.runner import SCENARIO_GPU_OVERHEAD_BYTES, gpu_jobs_cap, max_jobs, run_all
from kvtool.validate.runtime_differences import note_runtime_differences
from kvtool.validate.scenarios import SCENARIOS
from kvtool.validate.schedule import DEFAULT_SEED
from kvtool.validate.shrink import Cut
from kvtool.validate.user_store import user_store_folders, user_store_notice
from kvtool.vllm_compat.entry import VLLM_COMPAT, VLLM_DEFAULT_MODELS, run_vllm_validation
from kvtool.vllm_compat.install import VLLM_VERSION

DEFAULT_MODELS = ["tiny", "tiny-vswa"]
RUNTIME_HELP = ("The TensorRT-LLM runtime to run under (repeatable): " + "; ".join(
    f"{name}: {profile.summary}" for name, profile in RUNTIMES.items()) + ". Default: every one the connector "
    "can take part in (one it cannot, written for another, is skipped; named here, it fails).")
_STYLE = {Verdict.PASS: "green", Verdict.MISS: "cyan", Verdict.FAIL: "red", Verdict.ERROR: "red",
          Verdict.SKIP: "yellow"}


@clean_errors
def validate(
    target: Annotated[str, typer.Argument(help=f"{CONNECTOR_CHOICES}.")] = "host",
    model: Annotated[list[str], typer.Option(help="Model preset or config.json (repeatable; default tiny, "
                                                  "tiny-vswa).")] = [],
    runtime: Annotated[list[str], typer.Option(metavar="NAME", help=RUNTIME_HELP)] = [],
    tokens_per_block: Annotated[int, typer.Option(metavar="N", help="Tokens per block (small, so that every "
                                                  "scenario spans many blocks).")] = 4,
    scenario: Annotated[list[str], typer.Option(help="Run only this scenario (repeatable; see --list).")] = [],
    list_scenarios: Annotated[bool, typer.Option("--list", help="List the scenarios and checks, then exit.")] = False,
    connector_help: Annotated[bool, typer.Option("--connector-help", help="List TARGET's options, then exit.")] = False,
    junit: Annotated[Path | None, typer.Option(metavar="FILE", help="Write JUnit XML here (for CI).")] = None,
    format: Annotated[OutputFormat, typer.Option("--format", help=FORMAT_HELP)] = OutputFormat.table,
    output: Annotated[Path | None, typer.Option(metavar="DIR", help=OUTPUT_HELP.format(
        files="results.json, results.csv, junit.xml, tracebacks/SCENARIO-MODEL.txt"))] = None,
    json_out: Annotated[Path | None, typer.Option("--json", metavar="FILE", hidden=True,
                                                     help="Deprecated: use --output DIR.")] = None,
    connector_opt: Annotated[list[str], typer.Option(help="KEY=VALUE passed to the connector (repeatable).")] = [],
    compat: Annotated[str | None, typer.Option(help="trtllm: provide TensorRT-LLM's connector modules; vllm: "
                                                  "drive vLLM's own scheduler (pip install -e '.[vllm]') and "
                                                  "validate a vLLM connector (TARGET: a factory name, "
                                                  "MODULE:CLASS, FILE.py:CLASS or kvtool-host).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a scenario may take before it is stopped.")] = 60.0,
    jobs: Annotated[str, typer.Option(metavar="N|auto", help="Scenario processes at once (1: one after another); "
                                      "results come in the same order either way, and with --remote the "
                                      "remote-* scenarios run alone. At most one per CPU, a scenario taking "
                                      "--num-ranks of them (auto: that many; more is lowered to it). They "
                                      "share the machine, and --timeout, --load-timeout and --save-timeout "
                                      "are wall-clock: on a loaded machine many at once can fail a slow but "
                                      "correct connector.")] = "1",
    load_timeout: Annotated[float, typer.Option(metavar="SECONDS", help="Wall-clock seconds an asynchronous load "
                                                "may stay in flight before load-completes fails it.")] = 5.0,
    overlap: Annotated[bool, typer.Option(help="Let a scenario's finished process end (a GPU context's "
                                          "teardown) beside the next scenario; --no-overlap starts each "
                                          "scenario only once the processes before it have ended, for a "
                                          "connector holding a fixed port or lock until its process exits "
                                          "(KVBM's ZMQ ports).")] = True,
    warmup: Annotated[float, typer.Option(metavar="SECONDS", help="Wall-clock seconds every engine waits after the "
                                          "connector's setup before its first request, as TensorRT-LLM warms up "
                                          "before serving (0: asked at once, which finds a connector still "
                                          "setting up in the background).")] = 0.0,
    save_timeout: Annotated[float, typer.Option(metavar="SECONDS", help="Wall-clock seconds an asynchronous save "
                                                "(request_finished answered True) may stay unreported by get_finished "
                                                "before finished-ids fails it.")] = 5.0,
    seed: Annotated[int, typer.Option(help="Seed of the KV fingerprints and of the schedule (page order, batch "
                                      "and chunk sizes, poll delays, when async work may run, preemption "
                                      "points): the same seed, the same verdicts. 0 is the canonical "
                                      "schedule; see docs/validate-determinism.md.")] = DEFAULT_SEED,
    explore_seeds: Annotated[int, typer.Option("--explore", metavar="N", help="Run every scenario under N seeds "
                                               "(--seed, --seed + 1, ...), each a different schedule; a scenario "
                                               "stops at its first failure, printed with its seed and the command "
                                               "that reproduces it, then shrunk: the smallest case that still "
                                               "fails, with its command.")] = 0,
    max_requests: Annotated[int | None, typer.Option(metavar="K", help="Only the first K requests of each "
                                                        "engine run of a scenario (what --explore's shrink step "
                                                        "reports).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(metavar="M", help="At most M generated tokens a request "
                                                          "(what --explore's shrink step reports).")] = None,
    device: Annotated[str | None, typer.Option(metavar="cpu|cuda", help="Where the KV pages live "
                                                  "[default: cuda when a CUDA GPU is present, else cpu].")] = None,
    num_ranks: Annotated[int, typer.Option(help="Ranks per run: rank 0 in the scenario's process, the others as "
                                           "processes in a torch.distributed group, each with its own pools, "
                                           "fingerprints and worker.")] = 1,
    tp: Annotated[int, typer.Option(metavar="N", help="Tensor-parallel shards (N = --num-ranks): each rank holds "
                                    "1/N of the KV heads.")] = 1,
    remote: Annotated[str | None, typer.Option(metavar="URL", help="The server TARGET stores into (redis://... "
                      "or mooncake://HOST:RPC_PORT?metadata=URL), dedicated to the test: the remote-* scenarios "
                      "empty, pause and disconnect it.")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="A miss (a repeated prompt the connector did not "
                                         "serve: not wrong, only less than it could) fails its check.")] = False,
    all_rows: Annotated[bool, typer.Option("--all-rows", "--verbose", help="Show every row in the table, also "
                                           "the remote-* scenarios skipped for want of --remote (one line "
                                           "otherwise).")] = False,
) -> None:
    """Conformance-check a KV cache connector: exit 0 when every check passes, 1 when one fails,
    2 for usage errors or a TARGET that cannot be imported or constructed."""
    if compat == VLLM_COMPAT:
        _validate_vllm(target, model, tokens_per_block, connector_opt, seed, scenario, timeout, format, junit, output,
                       all_rows, list_scenarios)
        return
    if list_scenarios:
        _print_list()
        return
    if connector_help:
        install_compat(compat, (VLLM_COMPAT,))
        preflight(_absolute(target), _probe(DEFAULT_MODELS[0], tokens_per_block, [], compat), compat, timeout,
                  construct=False)
        print_connector_help(load_connector(_absolute(target), compat))
        return
    for name in scenario:
        if name not in SCENARIOS:
            raise InputError(f"unknown scenario {name!r}{suggest(name, SCENARIOS)}; see kvtool validate --list")
    runtimes = list(dict.fromkeys(runtime_name(name) for name in runtime)) or list(RUNTIMES)
    device = pages_device(device, "cuda" if torch.cuda.is_available() else "cpu")
    if tokens_per_block <= 0:
        raise InputError(f"tokens per block must be positive, got {tokens_per_block}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise InputError(f"--timeout must be a positive number of seconds, got {timeout}")
    if num_ranks < 1 or tp < 1 or tp not in (1, num_ranks):
        raise InputError(f"--num-ranks must be positive and --tp 1 or equal to it, got --num-ranks {num_ranks} "
                         f"--tp {tp}")
    jobs_at_once = _jobs(jobs, num_ranks)
    if not math.isfinite(load_timeout) or load_timeout <= 0:
        raise InputError(f"--load-timeout must be a positive number of seconds, got {load_timeout}")
    if not overlap and jobs_at_once > 1:
        raise InputError(f"--no-overlap runs one scenario process at a time: it needs --jobs 1, got --jobs {jobs}")
    if not math.isfinite(warmup) or not 0 <= warmup <= 600:
        raise InputError(f"--warmup must be 0 to 600 seconds, got {warmup}")
    if json_out is not None:
        deprecated("--json FILE", "--output DIR (results.json) or --format json")
        check_writable_file(json_out, "--json")
    if junit is not None:
        check_writable_file(junit, "--junit")
    if remote is not None:
        _check_remote(remote)
    folder = prepare_run_folder(output, "validate") if output is not None else None
    install_compat(compat, (VLLM_COMPAT,))
    models = [_resolved_model(m) for m in model] or DEFAULT_MODELS
    for name in models:
        note_model_origin(load_model(name))
        shard_model(load_model(name), tp, 0)   # exit 2 when --tp does not divide a model's heads
    if device == "cuda":
        jobs_at_once = _jobs_that_fit_the_gpu(jobs_at_once, models, tokens_per_block, num_ranks,
                                              asked=jobs.strip().lower() != "auto")
    notice = user_store_notice(user_store_folders())
    if notice:
        say(notice)
    # The target is imported and built in a child first: one that exits or hangs there is exit 2.
    preflight(_absolute(target), _probe(models[0], tokens_per_block, connector_opt, compat, seed, device),
              compat, timeout)
    spec = load_connector(_absolute(target), compat)
    options = tuple(connector_options(spec, connector_opt).items())
    if not math.isfinite(save_timeout) or save_timeout <= 0:
        raise InputError(f"--save-timeout must be a positive number of seconds, got {save_timeout}")
    if explore_seeds < 0:
        raise InputError(f"--explore must be a number of seeds (0: off), got {explore_seeds}")
    cut = _cut(max_requests, max_new_tokens)
    contexts = [Context(spec, m, tokens_per_block, options, seed, device, load_timeout, compat, num_ranks, tp, remote,
                        strict, save_timeout=save_timeout, cut=cut, warmup=warmup, runtime=name,
                        runtime_chosen=bool(runtime)) for name in runtimes for m in models]
    console = Console(stderr=True)

    def run_seeded(cs: list[Context], names: list[str], seeds: Sequence[int] = ()) -> list[CheckResult]:
        def progress(rs: list[CheckResult]) -> None:
            prefix = ""
            if explore_seeds and seeds and rs[0].seed is not None and not any(r.failed for r in rs):
                prefix = f"seeds {seeds[0]}..{seeds[-1]} " if len(seeds) > 1 else f"seed {seeds[0]} "
            elif explore_seeds:
                prefix = f"seed {rs[0].seed if rs[0].seed is not None else cs[0].seed} "
            if explore_seeds and not seeds:   # after a failure: the run alone, or a probe of the shrink step
                probe_cut = cs[0].cut   # a probe runs at a Cut; the run alone at the command's cut
                prefix += f"shrink to {probe_cut.short()}: " if probe_cut is not None and probe_cut != cut else \
                    "again, alone: "
            console.print(prefix + _progress_line(rs), highlight=False, markup=False)
        return run_all(cs, names, timeout, jobs=jobs_at_once, overlap=overlap, on_result=progress, seeds=seeds)

    findings: list[Finding] = []
    if explore_seeds:
        results, findings = explore(contexts, scenario or list(SCENARIOS), explore_seeds, run_seeded)
    else:
        results = run_seeded(contexts, scenario or list(SCENARIOS))
    seeds = SeedsRun(seed, explore_seeds, findings)
    repro = _reproduce_options(tokens_per_block, connector_opt, compat, device, num_ranks, tp, remote, strict)
    for finding in findings:
        console.print(finding.line(reproduce_command(target, finding, repro, cut or Cut())), highlight=False,
                      markup=False, soft_wrap=True)
        console.print(finding.smallest_line(reproduce_command(target, finding, repro, finding.smallest)),
                      highlight=False, markup=False, soft_wrap=True)
    results = note_runtime_differences(results)
    _print_results(results, target, models, format, all_rows, seeds)
    if junit:
        write_file(junit, junit_xml(results, target, seeds.properties()))
    if json_out:
        write_file(json_out, json.dumps(_document(results, target, models, seeds), indent=2) + "\n")
    if folder is not None:
        write_file(folder / "results.json", json.dumps(_document(results, target, models, seeds), indent=2) + "\n")
        write_file(folder / "results.csv", frame_text(_frame(results, seed), OutputFormat.csv))
        write_file(folder / "junit.xml", junit_xml(results, target, seeds.properties()))
        written = _write_tracebacks(folder, results)
        write_meta(folder, "validate", target=target, jobs=jobs_at_once)
        if written:
            console.print(f"tracebacks of {written} failures: {folder / TRACEBACKS}", highlight=False, markup=False)
    failed = [r for r in results if r.failed]
    if failed:
        raise fail(f"{summary_line(results)}; {seeds.words()}", ExitCode.CHECK_FAILED)
    Console(stderr=True).print(f"{summary_line(results)}; {seeds.words()}", highlight=False, markup=False)


def _validate_vllm(target: str, model: list[str], block_size: int, connector_opt: list[str], seed: int,
                   scenario: list[str], timeout: float, format: OutputFormat, junit: Path | None, output: Path | None,
                   all_rows: bool, list_scenarios: bool) -> None:
    """`--compat vllm`: vLLM's scenarios (`kvtool.vllm_compat`) against a vLLM connector."""
    from kvtool.vllm_compat.scenarios import SCENARIOS as VLLM_SCENARIOS

    if list_scenarios:
        _print_scenarios({s.name: s.purpose for s in VLLM_SCENARIOS.values()})
        return
    for name in scenario:
        if name not in VLLM_SCENARIOS:
            raise InputError(f"unknown --compat vllm scenario {name!r}{suggest(name, VLLM_SCENARIOS)}; "
                             "see kvtool validate --compat vllm --list")
    if block_size <= 0 or not math.isfinite(timeout) or timeout <= 0:
        raise InputError("--tokens-per-block and --timeout must be positive")
    folder = prepare_run_folder(output, "validate") if output is not None else None
    models = [_resolved_model(m) for m in model] or VLLM_DEFAULT_MODELS
    results = run_vllm_validation(target, parse_options(connector_opt), models, block_size, seed,
                                  scenario or list(VLLM_SCENARIOS), timeout,
                                  lambda rs: Console(stderr=True).print(_progress_line(rs), highlight=False,
                                                                        markup=False))
    _print_results(results, target, models, format, all_rows)
    if junit:
        write_file(junit, junit_xml(results, target, {}))
    if folder is not None:
        write_file(folder / "results.json", json.dumps(_document(results, target, models), indent=2) + "\n")
        write_file(folder / "junit.xml", junit_xml(results, target, {}))
        write_meta(folder, "validate", target=target, vllm=VLLM_VERSION)
    if any(r.failed for r in results):
        raise fail(f"{summary_line(results)}; seed {seed}", ExitCode.CHECK_FAILED)
    Console(stderr=True).print(f"{summary_line(results)}; seed {seed}", highlight=False, markup=False)


def _cut(max_requests: int | None, max_new_tokens: int | None) -> Cut | None:
    """--max-requests and --max-new-tokens as a cut (None: neither given); InputError unless positive."""
    for flag, value in (("--max-requests", max_requests), ("--max-new-tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be a positive integer, got {value}")
    return Cut(max_requests, max_new_tokens) if (max_requests, max_new_tokens) != (None, None) else None


def _jobs(value: str, num_ranks: int) -> int:
    """--jobs as a count: `auto` or a positive integer, lowered (with a warning) to `max_jobs`, so
    that no scenario process waits for a CPU; InputError for anything else."""
    cap = max_jobs(num_ranks)
    if value.strip().lower() == "auto":
        return cap
    try:
        jobs = int(value)
    except ValueError:
        jobs = 0
    if jobs <= 0:
        raise InputError(f"--jobs must be a positive integer or auto, got {value!r}")
    if jobs > cap:
        per = f" ({num_ranks} processes a scenario with --num-ranks {num_ranks})" if num_ranks > 1 else ""
        warn(f"--jobs {jobs}: this machine's CPUs run {cap} scenario{'s' * (cap != 1)} at once{per}; "
             f"running {cap}")
    return min(jobs, cap)


def _jobs_that_fit_the_gpu(jobs: int, models: list[str], tokens_per_block: int, num_ranks: int, asked: bool) -> int:
    """`jobs`, lowered to the scenarios whose processes fit the GPU's free memory together
    (`runner.gpu_jobs_cap`): beyond it, scenarios would fail out of memory, which would read as
    the connector's failures. Said as a warning when the count was `asked` for, else as a note."""
    cap = gpu_jobs_cap(models, tokens_per_block, num_ranks, torch.cuda.mem_get_info()[0])
    if jobs > cap:
        tell = warn if asked else say
        tell(f"--jobs {jobs}: the GPU's free memory holds {cap} scenario{'s' * (cap != 1)} at once "
             f"(about {SCENARIO_GPU_OVERHEAD_BYTES >> 30} GiB a process besides its pools); running {cap}")
    return min(jobs, cap)


def _check_remote(url: str) -> None:
    """InputError unless the --remote server answers."""
    try:
        remote_control(url).check()
    except InputError as exc:
        raise InputError(f"--remote {url}: {exc}") from None


def _resolved_model(name: str) -> str:
    """A config path made absolute now: scenarios run in temporary folders."""
    return name if name in PRESETS or not Path(name).exists() else str(Path(name).resolve())


def _probe(model: str, tokens_per_block: int, connector_opt: list[str], compat: str | None, seed: int = 0,
           device: str = "cpu") -> Context:
    """The context the preflight child builds the connector in (it finds the spec itself)."""
    return Context(None, model, tokens_per_block, tuple(parse_options(connector_opt).items()), seed, device,
                   compat=compat)


def _absolute(target: str) -> str:
    """A file target resolved now: each scenario runs in its own temporary directory."""
    where, sep, rest = target.partition(":")
    if sep and where.endswith(".py"):
        return f"{Path(where).resolve()}:{rest}"
    return target


def _progress_line(results: list[CheckResult]) -> str:
    r = results[0]
    marks = " ".join(f"{x.check}:{x.verdict.value}" for x in results)
    return f"{r.scenario}[{r.model}, {r.runtime}] {marks}"


TRACEBACKS = "tracebacks"


def _write_tracebacks(folder: Path, results: list[CheckResult]) -> int:
    """Every failure's whole traceback, one file per scenario and model
    (`tracebacks/SCENARIO-MODEL.txt`); how many were written."""
    by_file: dict[str, list[str]] = {}
    for r in results:
        if r.tracebacks:
            texts = by_file.setdefault(f"{r.scenario}-{_file_part(r.model)}-{r.runtime}.txt", [])
            texts += [t for t in r.tracebacks if t not in texts]
    for name, texts in by_file.items():
        write_file(folder / TRACEBACKS / name, "\n\n".join(texts) + "\n")
    return sum(len(texts) for texts in by_file.values())


def _file_part(name: str) -> str:
    """A model's name (a preset, or a config.json path) as part of a file name."""
    if name.endswith(".json"):
        name = "-".join(Path(name).parts[-2:])
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "model"


def _reproduce_options(tokens_per_block: int, connector_opt: list[str], compat: str | None, device: str,
                       num_ranks: int, tp: int, remote: str | None, strict: bool) -> list[str]:
    """The options of this run a reproduce command repeats (those that change what runs)."""
    words = [] if tokens_per_block == 4 else ["--tokens-per-block", str(tokens_per_block)]
    for option in connector_opt:
        words += ["--connector-opt", option]
    for flag, value, default in (("--compat", compat, None), ("--device", device, None), ("--num-ranks", num_ranks, 1),
                                 ("--tp", tp, 1), ("--remote", remote, None)):
        words += [flag, str(value)] if value != default else []
    return words + (["--strict"] if strict else [])


def _print_results(results: list[CheckResult], target: str, models: list[str], format: OutputFormat,
                   all_rows: bool = False, seeds: SeedsRun | None = None) -> None:
    if format is OutputFormat.table:
        width = report_width(140)
        Console(width=width).print(_table(results, target, all_rows, width))
    elif format is OutputFormat.json:
        print(json.dumps(_document(results, target, models, seeds), indent=2))
    else:
        print(frame_text(_frame(results, seeds.seed if seeds else 0), format), end="")


def _frame(results: list[CheckResult], seed: int) -> pd.DataFrame:
    """One row a result; `seed` is that of every row whose result does not name its own."""
    rows = [{**r.as_dict(), "evidence": "; ".join(r.evidence), "seed": r.seed if r.seed is not None else seed}
            for r in results]
    for row in rows:
        del row["tracebacks"]   # many lines each: results.json and tracebacks/ hold them
    return pd.DataFrame(rows)


NARROW = 110
"""Below this console width the table stacks scenario over model and check over verdict, so that
the evidence keeps room and no name is folded."""


def _table(results: list[CheckResult], target: str, all_rows: bool = False, width: int = 140) -> Table:
    """One row per check; without `all_rows`, the remote-* scenarios skipped for want of --remote
    take one row together at the end, and so do, per runtime, the scenarios whose case cannot
    happen under it. Names never fold (their columns are as wide as the longest), the evidence
    does; below NARROW columns, scenario and model share a cell, and so do check, verdict and time."""
    remote = [] if all_rows else [r for r in results if _needs_remote(r)]
    not_here = [] if all_rows else [r for r in results if _not_run_here(r)]
    folded = {id(r) for r in remote + not_here}
    rows: list[tuple[str, ...]] = [
        (r.scenario, f"{r.model}\n{r.runtime}", r.check, f"[{_STYLE[r.verdict]}]{r.verdict.value}[/]",
         f"{r.seconds:.2f}s", _evidence_cell(r)) for r in results if id(r) not in folded]
    for runtime in dict.fromkeys(r.runtime for r in not_here):
        rows.append(_folded_row([r for r in not_here if r.runtime == runtime], "not run here",
                                f"their case cannot happen under {runtime} (--all-rows shows each, and why)"))
    if remote:
        rows.append(_folded_row(remote, "remote-*", "skipped, needs --remote URL (--all-rows shows each)"))
    table = Table(title=f"kvtool validate {target}")
    if width < NARROW:
        rows = [(f"{a.replace(' (', chr(10) + '(', 1)}\n{b}", f"{c}\n{d} {e}".lstrip(), f) for a, b, c, d, e, f in rows]
        columns: tuple[str, ...] = ("scenario / model, runtime", "check / verdict", "evidence")
    else:
        columns = ("scenario", "model / runtime", "check", "verdict", "time", "evidence")
    for i, column in enumerate(columns[:-1]):
        longest = max([len(column)] + [len(line) for row in rows
                                       for line in re.sub(r"\[/?\w*\]", "", row[i]).split("\n")])
        table.add_column(column, overflow="fold", min_width=longest)
    table.add_column(columns[-1], overflow="fold", ratio=1)
    for row in rows:
        table.add_row(*row)
    return table


def _folded_row(folded: list[CheckResult], name: str, why: str) -> tuple[str, ...]:
    """One table row standing for `folded` (skips), named by `name` and how many they are."""
    scenarios = list(dict.fromkeys(r.scenario for r in folded))
    models = list(dict.fromkeys(r.model for r in folded))
    runtimes = list(dict.fromkeys(r.runtime for r in folded))
    what = f"{len(scenarios)} scenario{'s' * (len(scenarios) != 1)} × {len(models)} model{'s' * (len(models) != 1)}"
    return (f"{name} ({what})", ", ".join(models) + "\n" + ", ".join(runtimes), "", f"[{_STYLE[Verdict.SKIP]}]skip[/]",
            f"{sum(r.seconds for r in folded):.2f}s", why)


def _not_run_here(r: CheckResult) -> bool:
    """A scenario skipped because the runtime's case cannot happen (`Scenario.runs_on`)."""
    return r.check == "scenario" and r.verdict is Verdict.SKIP and r.scenario in SCENARIOS \
        and r.runtime in RUNTIMES and r.runtime not in SCENARIOS[r.scenario].runs_on


def _evidence_cell(r: CheckResult) -> str:
    evidence = "; ".join(r.evidence[:3]) if r.verdict is not Verdict.PASS else (r.evidence[0] if r.evidence else "")
    return evidence[:400]


_REMOTE_SCENARIOS = frozenset(s.name for s in REMOTE_SCENARIOS)


def _needs_remote(r: CheckResult) -> bool:
    """A remote-* scenario's row skipped because no --remote URL was given."""
    return r.scenario in _REMOTE_SCENARIOS and r.verdict is Verdict.SKIP and r.evidence == [NEEDS_REMOTE]


def _document(results: list[CheckResult], target: str, models: list[str], seeds: SeedsRun | None = None) -> dict:
    return {"target": target, "models": models, "runtimes": list(dict.fromkeys(r.runtime for r in results)),
            **(seeds.as_dict() if seeds else {}),
            "passed": not any(r.failed for r in results),
            "num_failed": sum(r.failed for r in results), "num_missed": sum(r.verdict is Verdict.MISS for r in results),
            "summary": summary_line(results), "results": [r.as_dict() for r in results]}


def _print_list() -> None:
    _print_scenarios({s.name: s.purpose for s in SCENARIOS.values()})


def _print_scenarios(purposes: dict[str, str]) -> None:
    console = Console(width=max(120, Console().width))
    scenarios = Table(title="scenarios")
    scenarios.add_column("scenario")
    scenarios.add_column("purpose")
    for name, purpose in purposes.items():
        scenarios.add_row(name, purpose)
    checks = Table(title="checks")
    checks.add_column("check")
    checks.add_column("purpose")
    for name, purpose in CHECKS.items():
        checks.add_row(name, purpose)
    console.print(scenarios)
    console.print(checks)
