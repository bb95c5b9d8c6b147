"""A stand-in for validate's scenario child (`runner._child`) running several seeds (`run_seeds`),
which moves no bytes: each seed's start is announced as the real child announces it, and the
scenario named by the `hold` option, at its last seed, waits (up to 30 s) for every scenario named
in `others` to have started before it answers. With a scheduler that waited for the held process
to answer before it started the others, they never start first, and it answers FAIL."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.runner import SeedStarted


def seeded_child(send, name: str, ctx_blob: bytes, compat: str | None, seeds: tuple[int, ...] = ()) -> None:
    ctx = pickle.loads(ctx_blob)
    options = dict(ctx.spec.options)
    folder = Path(options["folder"])
    (folder / f"started-{name}").touch()
    others = options["others"].split(",")
    verdict = Verdict.PASS
    for seed in seeds or (ctx.seed,):
        send.send(SeedStarted(seed, time.monotonic()))
        if name == options["hold"] and seed == (seeds or (ctx.seed,))[-1]:
            deadline = time.monotonic() + 30
            while not all((folder / f"started-{o}").exists() for o in others) and time.monotonic() < deadline:
                time.sleep(0.02)
            verdict = Verdict.PASS if all((folder / f"started-{o}").exists() for o in others) else Verdict.FAIL
    send.send([CheckResult(name, ctx.model, "scenario", verdict, 0.0, [], seed=seeds[0] if seeds else None)])
    send.close()
    os._exit(0)
