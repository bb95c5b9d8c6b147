"""The runtime profiles: every TensorRT-LLM runtime a connector meets, each a module over one engine.

`profile_of(name)` gives one; `RUNTIMES` lists them in the order reports show them. `DEFAULT_RUNTIME`
is what `bench` and `trace` run unless told otherwise (`validate` runs every profile by default).
"""

from __future__ import annotations

from kvtool.engine.runtimes.names import DEFAULT_RUNTIME, Registration, RuntimeName
from kvtool.engine.runtimes.profile import BringUp, CapacityPolicy, RuntimeProfile
from kvtool.engine.runtimes.trtllm_v1 import TrtllmV1
from kvtool.engine.runtimes.trtllm_v2 import TrtllmV2
from kvtool.engine.runtimes.trtllm_v2_release import ReleaseV2
from kvtool.errors import InputError, did_you_mean

__all__ = ["BringUp", "CapacityPolicy", "DEFAULT_RUNTIME", "RUNTIMES", "Registration", "RuntimeName",
           "RuntimeProfile", "profile_of", "runtime_name"]

RUNTIMES: dict[RuntimeName, RuntimeProfile] = {profile.name: profile
                                               for profile in (TrtllmV1(), TrtllmV2(), ReleaseV2())}


def profile_of(name: RuntimeName | str) -> RuntimeProfile:
    return RUNTIMES[runtime_name(name)]


def runtime_name(text: RuntimeName | str) -> RuntimeName:
    """The runtime called `text`; InputError naming the known ones otherwise."""
    try:
        return RuntimeName(text)
    except ValueError:
        known = ", ".join(str(name) for name in RUNTIMES)
        raise InputError(f"no runtime {text!r}{did_you_mean(str(text), RUNTIMES)}; known: {known}") from None
