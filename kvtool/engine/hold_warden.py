"""The one wait `held_work` cannot see: a connector hook that waits for its held work by other
means than the future or the thread (an event the work sets, a queue it fills). The warden, a
thread of kvtool's own, watches the runtime's thread while it is inside a hook with work held:
asleep there without a break for HOOK_GRACE_S, it is taken to wait for that work, which is
released. A hook that is only slow (running, or briefly waiting for the GIL) keeps it held.
"""

from __future__ import annotations

import threading
import time

from kvtool.engine.async_gate import HOOK_GRACE_S, thread_state
from kvtool.engine.held_work import HeldWork


class HoldWarden:
    def __init__(self, work: HeldWork) -> None:
        self._work = work
        self._owner_native = threading.get_native_id()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="kvtool-hold-warden", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(1.0)

    def hook_entered(self) -> None:
        """The runtime's thread entered a hook: watch it if work is held."""
        if self._work.num_held:
            with self._wake:
                self._wake.notify()

    def _watching(self) -> bool:
        return not self._stopped and self._work.in_hook and self._work.num_held > 0

    def _watch(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self._watching())
                if self._stopped:
                    return
            self._watch_one_hook()

    def _watch_one_hook(self) -> None:
        """Release the held work once the runtime's thread slept through HOOK_GRACE_S in one hook."""
        seq, asleep_since = self._work.hook_seq, None
        while self._watching() and self._work.hook_seq == seq:
            time.sleep(HOOK_GRACE_S / 5)
            now = time.monotonic()
            asleep = thread_state(self._owner_native) in (b"S", b"D")
            asleep_since = (asleep_since or now) if asleep else None
            if asleep_since is not None and now - asleep_since > HOOK_GRACE_S:
                self._work.release_all("waited")
                return
