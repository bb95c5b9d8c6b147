"""How much of this process's memory is resident: what tests of lazily committed stores measure."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """This process's resident set (Linux: /proc/self/statm), in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
