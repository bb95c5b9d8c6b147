"""The clock the runtime's waits on a connector are measured by (`watchdogs`): wall-clock time,
except where the connector visibly has nothing in flight.

An idle iteration (nothing could run; every live request waits on the connector) used to sleep
`idle_wait_seconds` and poll again, so a connector that never reports cost a whole timeout of
wall-clock polling. Now an idle poll at which the connector is quiet (`ConnectorWork.idle`: none
of its work held or running, no thread of its own alive outside its pools, no other thread of
this process runnable: `quiet_process`) advances the clock by a step that doubles at each quiet
poll in a row, while sleeping only 1/SPEEDUP of it: a timeout of 5 s is reached in about 0.1 s
and about 15 polls. Work kvtool cannot see (a native thread asleep on a device or the network)
thus gets `timeout / SPEEDUP` of wall-clock time at least (raise `--save-timeout` or
`--load-timeout` for more); any poll at which something runs sleeps for real and starts the steps
again.
"""

from __future__ import annotations

import os
import threading
import time

SPEEDUP = 50.0
"""How much faster than the wall clock the clock runs while the connector is quiet."""
MAX_STEP_S = 1.0
"""The largest step one quiet poll advances the clock by."""


class ConnectorClock:
    def __init__(self) -> None:
        self._skipped = 0.0
        self._step = 0.0

    def now(self) -> float:
        """Seconds, in `time.monotonic()`'s origin, plus every second skipped so far."""
        return time.monotonic() + self._skipped

    def wait(self, seconds: float, quiet: bool) -> None:
        """An idle poll's wait of `seconds`: slept, or (`quiet`) a growing step mostly skipped."""
        if not quiet:
            self._step = 0.0
            time.sleep(seconds)
            return
        self._step = min(MAX_STEP_S, max(seconds, self._step * 2))
        time.sleep(self._step / SPEEDUP)
        self._skipped += self._step - self._step / SPEEDUP

    def progress(self) -> None:
        """Something ran: the next quiet poll starts from the smallest step again."""
        self._step = 0.0


def quiet_process() -> bool:
    """Whether no thread of this process but the caller's is running or waiting for a core
    (Linux: /proc; elsewhere False, so the clock stays the wall clock)."""
    me = str(threading.get_native_id())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"R":
                    return False
        except (OSError, IndexError):
            continue     # it ended meanwhile
    return True
