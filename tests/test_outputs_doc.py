"""docs/outputs.md names every key of `validate`'s results.json and every column of its
results.csv, and no key the command does not write."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kvtool.validate.explore import Finding, SeedsRun

ROOT = Path(__file__).parents[1]


def _validate_section() -> str:
    text = (ROOT / "docs" / "outputs.md").read_text()
    return text[text.index("**`validate --output DIR`**"):]


def documented_keys(section: str) -> set[str]:
    """The quoted keys of the section's first json block."""
    block = re.search(r"```json\n(.*?)```", section, re.S)[1]
    return set(re.findall(r'"(\w+)":', block))


def keys_of(document: dict) -> set[str]:
    """Every key of DOCUMENT, of its results' rows and of a finding's (a passing run has none: the
    keys are those SeedsRun writes for one)."""
    finding = SeedsRun(seed=0, num_explored=1, findings=[Finding("s", "m", 0, ("c",))]).as_dict()["findings"][0]
    return set(document).union(*map(set, document["results"]), finding)


def test_the_documented_validate_outputs_are_the_written_ones(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", "host", "--scenario", "cold-warm",
                           "--model", "tiny", "--explore", "2", "--output", str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "run" / "results.json").read_text())
    section = _validate_section()
    assert keys_of(document) == documented_keys(section)
    with open(tmp_path / "run" / "results.csv") as f:
        header = next(csv.reader(f))
    assert f"`{','.join(header)}`" in re.sub(r",\s*\n", ",", section), header


def test_a_key_added_and_not_documented_is_found():
    section = '```json\n{"target": str, "results": [{"check": str}]}\n```'
    written = keys_of({"target": "host", "seed": 0, "results": [{"check": "x"}], "findings": []})
    assert written - documented_keys(section) == {"seed", "findings", "scenario", "model", "checks", "runtime",
                                                         "max_requests", "max_new_tokens", "alone"}
