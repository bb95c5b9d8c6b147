"""Every command in a fenced `bash` block of README.md and docs/*.md says where it runs, in an HTML
comment on the line before the block, and this file holds it to that:

- `<!-- doc-commands: test -->`: run here, the block as one bash script (`kvtool` is `python -m
  kvtool` of this tree), in a scratch folder where `workloads/`, `examples/`, `tests/` and what
  `results/` holds are this repository's (what a block writes stays there); it must exit 0.
- `<!-- doc-commands: redis -->`: the same against a redis-server this test starts on a free port
  (the block's `6379` becomes that port; its install and server lines are what the test does
  itself); skipped where redis-server cannot be had.
- `<!-- doc-commands: gpu -->`: commands that need a CUDA GPU: on a machine without one each must
  exit 2 with one line saying why (skipped where CUDA is present).
- `<!-- doc-commands: ci -->`: `.ci/run` runs each command whole (every `&&` part, `python -m pip`
  read as `pip`, `-q` and `--junit FILE` ignored): the test finds it there.
- `<!-- doc-commands: not-run (WHY) -->`: run nowhere; WHY must say what it needs and what runs
  instead. `test_the_commands_run_nowhere_are_few` lists them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.servers import RedisServer, need_redis

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-commands: (?P<where>[a-z-]+)(?: \((?P<why>[^)]*)\))? -->\n)?```bash\n(?P<body>.*?)```",
                   re.S)
KINDS = {"test", "redis", "gpu", "ci", "not-run"}
LINKED = ("workloads", "examples", "tests")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    where: str | None
    why: str | None
    body: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """Its commands, continuation lines joined and comments dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.body)
        return [c for c in (re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()) if c]


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            found.append(Block(path, text[:m.start("body")].count("\n"), m["where"], m["why"], m["body"]))
    return found


def of(kind: str) -> list[Block]:
    return [b for b in blocks() if b.where == kind]


def test_every_block_says_where_it_runs():
    unmarked = [str(b) for b in blocks() if b.where not in KINDS or (b.where == "not-run") != bool(b.why)]
    assert not unmarked, \
        f"mark these bash blocks with <!-- doc-commands: test|redis|gpu|ci|not-run (why) -->: {unmarked}"
    assert len(of("test")) >= 5 and of("ci")


def _run(block: Block, tmp_path: Path, script: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    for name in LINKED:
        if not (tmp_path / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    results = tmp_path / "results"   # entries linked one by one: a run's own results/DATE/ lands in tmp_path
    results.mkdir(exist_ok=True)
    for entry in (ROOT / "results").iterdir():
        if not (results / entry.name).exists():
            (results / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env_extra or {})}
    prelude = f'set -euo pipefail\nkvtool() {{ "{sys.executable}" -m kvtool "$@"; }}\n'
    return subprocess.run(["bash", "-c", prelude + script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("block", of("test"), ids=str)
def test_a_test_block_runs(block, tmp_path):
    done = _run(block, tmp_path, block.body)
    assert done.returncode == 0, f"{block}: exit {done.returncode}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("block", of("redis"), ids=str)
def test_a_redis_block_runs_against_a_server_of_its_own(block, tmp_path):
    need_redis()
    server = RedisServer().start()
    try:
        lines = [line for line in block.body.splitlines() if not re.match(r"\s*(apt-get|pip|redis-server)\b", line)]
        done = _run(block, tmp_path, "\n".join(lines).replace("6379", str(server.port)))
    finally:
        server.stop()
    assert done.returncode == 0, f"{block}: exit {done.returncode}\n{done.stderr[-3000:]}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="they run on a GPU machine (docs/gpu-sessions.md)")
@pytest.mark.parametrize("block", of("gpu"), ids=str)
def test_a_gpu_block_says_so_without_a_gpu(block, tmp_path):
    for command in block.commands():
        done = _run(block, tmp_path, command)
        errors = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith("kvtool: error: "), \
            (command, done.stderr)
        assert "CUDA" in errors[0] or "cannot run here" in errors[0], errors


def _normal(command: str) -> str:
    """COMMAND with `python -m pip` read as `pip`, and without `-q` or `--junit FILE` (CI names its own)."""
    command = re.sub(r"\s(?:-q|--junit \S+)(?=\s|$)", "", command.replace("python -m pip", "pip"))
    return re.sub(r"\s+", " ", command).strip()


def _ci_runs(command: str, ci_lines: list[str]) -> bool:
    """Whether a line of .ci/run runs COMMAND whole: nothing after it but the line's end, `&&`, `;`
    or a comment (so `kvtool validate` is not found in `kvtool validate disk`)."""
    whole = re.compile(rf"(?:^|[\s;&(]){re.escape(command)}(?=$|\s*(?:&&|;|#))")
    return any(whole.search(line) for line in ci_lines)


@pytest.mark.parametrize("block", of("ci"), ids=str)
def test_ci_runs_a_ci_block(block):
    ci_lines = [_normal(line) for line in re.sub(r"\\\n\s*", " ", (ROOT / ".ci" / "run").read_text()).splitlines()]
    missing = [part for command in block.commands() for part in map(_normal, command.split("&&"))
               if not _ci_runs(part, ci_lines)]
    assert not missing, f"{block}: .ci/run does not run {missing}"


def test_a_command_ci_runs_only_in_part_is_not_found():
    ci_lines = ["validation validate-disk kvtool validate disk --junit ci-reports/validate-disk.xml",
                "python -m pytest -q"]
    ci_lines = [_normal(line) for line in ci_lines]
    assert not _ci_runs("kvtool validate", ci_lines) and not _ci_runs("kvtool validate dis", ci_lines)
    assert _ci_runs("kvtool validate disk", ci_lines) and _ci_runs("python -m pytest", ci_lines)


def test_the_commands_run_nowhere_are_few():
    """Each says why; there are no more than these."""
    reasons = {str(b): b.why for b in of("not-run")}
    assert all(len(why.split()) >= 4 for why in reasons.values()), reasons
    # the fifth: vLLM's CPU build, an extra CI does not install; the sixth: the GPU session of held work
    assert len(reasons) <= 6, reasons


def test_a_block_without_a_mark_is_found(tmp_path):
    text = "intro\n\n```bash\nkvtool --version\n```\n"
    (m,) = BLOCK.finditer(text)
    assert m["where"] is None and m["body"] == "kvtool --version\n"
