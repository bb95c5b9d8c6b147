"""Every relative link of README.md and docs/*.md names a file or folder of this repository (read
from the linking file's own folder, as GitHub reads it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?:#[^)\s]*)?\)")


def broken_links(path: Path, text: str) -> list[str]:
    """`path:line target` of each relative link in TEXT that does not resolve from PATH's folder."""
    found = []
    for m in LINK.finditer(text):
        target = m["target"]
        if target and not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
            found.append(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1} {target}")
    return found


def test_every_relative_link_resolves():
    broken = [b for path in DOCS for b in broken_links(path, path.read_text())]
    assert not broken, broken


def test_a_link_read_from_the_wrong_folder_is_found():
    text = "[ok](layout-api.md) [web](https://example.org/x) [anchor](#top)\n[bad](results/ci-times/)\n"
    assert broken_links(ROOT / "docs" / "bench.md", text) == ["docs/bench.md:2 results/ci-times/"]
