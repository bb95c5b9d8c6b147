"""How a process's threads wait for the GPU, read back from the driver, and a host connector that
records it where a validate scenario runs it (its scenario process)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvtool.connectors.host import HostConnectorWorker

RECORD_OPTION = "record"
"""The connector option naming the file `RecordsHowItWaits` writes to (an option, not an environment
variable: a fork server started earlier would not pass a new one on)."""


def primary_context_waits(ordinal: int = 0) -> str:
    """`auto`, `spin`, `yield` or `blocking`: the scheduling flags of GPU `ordinal`'s primary context."""
    driver = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0
    assert driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return {0: "auto", 1: "spin", 2: "yield", 4: "blocking"}.get(flags.value & 0x07, hex(flags.value))


class RecordsHowItWaits(HostConnectorWorker):
    def register_kv_cache_layout(self, layout) -> None:
        super().register_kv_cache_layout(layout)
        Path(self._llm_args.connector_options[RECORD_OPTION]).write_text(primary_context_waits())
