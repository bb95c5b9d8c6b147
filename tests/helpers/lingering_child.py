"""A stand-in for validate's scenario child (`runner._child`) that stays alive after sending its
results, as a child on a GPU does while the driver tears its context down. It lives in a module,
and reads its settings from the connector's options, so that a fork server's child runs it too.

Every child first writes `started-PID` into the `linger-folder` option's folder. The child of the
scenario named by `linger-after` then writes its pid to `lingering-pid` and stays alive for
`linger-s` seconds. With `linger-until` = `another-starts`, it ends sooner: once another child's
`started-*` appears, it writes `overlapped` and ends."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import torch

from kvtool.validate.runner import run_scenario


def lingering_options(folder: Path, after: str, seconds: float, until: str = "another-starts") -> dict[str, str]:
    return {"linger-folder": str(folder), "linger-after": after, "linger-s": str(seconds), "linger-until": until}


def lingering_child(send, name: str, ctx_blob: bytes, compat: str | None, seeds: tuple[int, ...] = ()) -> None:
    ctx = pickle.loads(ctx_blob)
    options = dict(ctx.spec.options)
    folder = Path(options["linger-folder"])
    mine = folder / f"started-{os.getpid()}"
    mine.touch()
    torch.set_num_threads(1)     # as the real one: a forked child must not enter the parent's OpenMP pool
    send.send(run_scenario(name, ctx, collect=False))
    send.close()
    if name == options["linger-after"]:
        (folder / "lingering-pid").write_text(str(os.getpid()))
        deadline = time.monotonic() + float(options["linger-s"])
        while time.monotonic() < deadline:
            if options["linger-until"] == "another-starts" and set(folder.glob("started-*")) - {mine}:
                (folder / "overlapped").touch()
                break
            time.sleep(0.01)
    os._exit(0)
