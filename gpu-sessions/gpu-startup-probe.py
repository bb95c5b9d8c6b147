"""Where a validate scenario process's seconds go on device pages.

On an H100 every scenario process of `validate host-async --device cuda` took 5-6 s with 20 running
at once, `setup` (one registration) included, against 0.2-0.3 s on a CPU. A probe process times, in
the order a scenario process meets them: CUDA ready (context, first tensor), `setup` (pools, the
connector built and registered), `setup` again in the same process (what a scenario costs once CUDA
is up), and one `cold-warm`. `--at-once N` starts N probes together from a fork server preloading
torch and kvtool, as validate's scenario processes are. One JSON line per probe, then the medians.

    python3 gpu-sessions/gpu-startup-probe.py --at-once 1
    python3 gpu-sessions/gpu-startup-probe.py --at-once 16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing
import pstats
import statistics
import time


def probe(connector: str, device: str, queue, profile: bool = False) -> None:
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    started = time.perf_counter()
    marks = {}

    def mark(name: str) -> None:
        marks[name] = round(time.perf_counter() - started - sum(marks.values()), 3)

    import torch
    if device == "cuda":
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    mark("cuda_ready")
    from kvtool.connectors.registry import load_connector
    from kvtool.validate.harness import Context
    from kvtool.validate.runner import run_scenario
    ctx = Context(load_connector(connector), "tiny", device=device)
    mark("connector_imported")
    problems = []
    for name in ("setup", "setup", "cold-warm"):
        verdicts = {r.verdict.value for r in run_scenario(name, ctx)}
        mark(f"{name}{'_again' if name in marks else ''}")
        problems += [f"{name}: {v}" for v in sorted(verdicts - {"pass", "skip"})]
    report = {**marks, "problems": problems}
    if profiler:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        report["profile"] = text.getvalue()
    queue.put(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at-once", type=int, default=1)
    parser.add_argument("--connector", default="host-async")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="the first probe's cProfile, top 40 by cumulative")
    args = parser.parse_args()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "kvtool.validate.runner"])
    queue = context.Queue()
    processes = [context.Process(target=probe, args=(args.connector, args.device, queue, i == 0 and args.profile))
                 for i in range(args.at_once)]
    for process in processes:
        process.start()
    results = []
    for _ in processes:
        results.append(queue.get(timeout=600))
        profile = results[-1].pop("profile", None)
        print(json.dumps(results[-1]), flush=True)       # as they come: a probe cut short loses no other
        if profile:
            print(profile, flush=True)
    for process in processes:
        process.join()
    keys = [k for k in results[0] if k not in ("problems", "profile")]
    print(json.dumps({"at_once": args.at_once, "median": {k: statistics.median(r[k] for r in results) for k in keys}}))


if __name__ == "__main__":
    main()
