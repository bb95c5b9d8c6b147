"""A runtime profile: one TensorRT-LLM runtime a connector ships into, as kvtool's one engine plays it.

The engine (manager, scheduler loop, pass driver, fake engine) is the same under every profile.
What differs between the runtimes a connector meets is gathered here, one module per profile
(`trtllm_v1`, `trtllm_v2`, `trtllm_v2_release`):

- when the connector is asked, with what, and what happens to its answer (`ConnectorAdmission`,
  which the scheduler calls at a waiting request's first chunk, at every later chunk's growth, and
  once the batch is final);
- how a worker is handed the KV cache (`Registration`) and which form of the page-list hooks the
  scheduler side is called with (`flat_hooks`);
- what a `RequestData` carries besides pages and tokens (`annotate`: V1's block hashes and priorities);
- what TensorRT-LLM refuses at bring-up with a connector attached (`refusal`, in its words).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvtool.connector.runtime import PastThePrompt
from kvtool.engine.runtimes.names import Registration, RuntimeName
from kvtool.errors import RefusedSetupError
from kvtool.types import TextEnum

__all__ = ["BringUp", "CapacityPolicy", "Registration", "RuntimeName", "RuntimeProfile"]

if TYPE_CHECKING:
    from kvtool.connector.api import RequestData
    from kvtool.connector.loader import ConnectorSpec
    from kvtool.engine.engine_config import EngineConfig
    from kvtool.engine.request_state import RequestState
    from kvtool.engine.runtimes.admission import AdmissionHost, ConnectorAdmission


class CapacityPolicy(TextEnum):
    """How waiting requests are admitted (TensorRT-LLM's capacity scheduler policy; `greedy` is kvtool's own)."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GREEDY = "greedy"
    """Admit whenever the first chunk gets pages, pause nobody (no TensorRT-LLM policy is this)."""

    @classmethod
    def of(cls, reserve_outputs: bool, pause_to_grow: bool) -> CapacityPolicy:
        if pause_to_grow:
            return cls.MAX_UTILIZATION
        return cls.GUARANTEED_NO_EVICT if reserve_outputs else cls.GREEDY


@dataclass(frozen=True)
class BringUp:
    """What a profile's refusals read: the engine's configuration and the connector's classes."""

    window_sizes: frozenset[int | None]
    """The distinct attention windows of the model's layers (None: full attention)."""
    host_cache_bytes: int
    disk_cache_bytes: int
    capacity_policy: CapacityPolicy
    draft_tokens: int
    scheduler_class: type
    worker_class: type

    @classmethod
    def of(cls, config: EngineConfig, connector: ConnectorSpec) -> BringUp:
        scheduler = config.scheduler
        return cls(frozenset(layer.window_size for layer in config.manager.model.layers),
                   config.manager.host_cache_bytes, config.manager.disk_cache_bytes,
                   CapacityPolicy.of(scheduler.reserve_outputs, scheduler.pause_to_grow), config.draft_tokens,
                   connector.scheduler_class, connector.worker_class)


class RuntimeProfile(ABC):
    """One runtime's semantics over kvtool's engine. Stateless: `admission` builds what an engine keeps."""

    name: ClassVar[RuntimeName]
    summary: ClassVar[str]
    """One line: what sets this runtime apart, for `--help` and the docs."""
    follows: ClassVar[str]
    """The TensorRT-LLM sources (files, PRs, commits) this profile was read from."""
    registration: ClassVar[Registration]
    flat_hooks: ClassVar[bool] = False
    """`update_state_after_alloc` and `request_finished` are called in their flat form (one list of
    pool-wide block ids), and `new_block_ids_by_layer_group` is `[]` (V1); else the per-layer-group forms."""
    calls_cancel_load: ClassVar[bool] = False
    past_the_prompt: ClassVar[PastThePrompt] = PastThePrompt.REPAIR
    """What an offer past the prompt's end becomes (a contract violation in every runtime)."""
    refuses_zero_async: ClassVar[bool] = False
    """`(0, True)` fails the request (the runtime's query raises), rather than being repaired to `(0, False)`."""
    use_kv_cache_manager_v2: ClassVar[bool] = True
    """What `llm_args.kv_cache_config.use_kv_cache_manager_v2` says to the connector."""
    capacity_policies: ClassVar[frozenset[CapacityPolicy]] = frozenset(CapacityPolicy)
    """The admissions a connector may run under."""
    default_capacity_policy: ClassVar[CapacityPolicy] = CapacityPolicy.GREEDY
    """What validate's scenarios run under unless they ask for a policy of their own."""

    @abstractmethod
    def refusal(self, bring_up: BringUp) -> str | None:
        """What TensorRT-LLM says when it refuses this setup with a connector attached (its own
        words), or None when it runs it."""

    def check(self, bring_up: BringUp) -> None:
        """RefusedSetupError when this runtime refuses the setup with the connector attached: the
        model or configuration first, then the connector's classes (`blames_connector`)."""
        refusal = self.refusal(bring_up)
        if refusal is not None:
            raise RefusedSetupError(f"{self.name} refuses this setup: {refusal}")
        blame = self.connector_refusal(bring_up)
        if blame is not None:
            raise RefusedSetupError(f"{self.name} refuses this connector: {blame}", blames_connector=True)

    def cannot_host(self, scheduler_class: type, worker_class: type) -> str | None:
        """Why a connector of these classes cannot take part in this runtime at all (not a bug of
        its own: it was written for another runtime), or None. Default: it can."""
        return None

    def connector_refusal(self, bring_up: BringUp) -> str | None:
        """The refusal that blames the connector's classes (a partial implementation), or None."""
        return None

    @abstractmethod
    def admission(self, host: AdmissionHost) -> ConnectorAdmission:
        """The per-engine half: what the scheduler calls around a request's allocation."""

    def annotate(self, data: RequestData, state: RequestState, is_new: bool) -> None:
        """Fill what this runtime reports beyond pages and tokens (default: nothing, as V2)."""

    @property
    def reserves_outputs(self) -> bool:
        """Whether a connector runs under output reservation here by default (GUARANTEED_NO_EVICT)."""
        return self.default_capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT

    def capacity_refusal(self, policy: CapacityPolicy) -> str | None:
        """The refusal of a capacity policy this runtime does not run a connector under, or None."""
        if policy in self.capacity_policies:
            return None
        return f"{self.name} runs a connector only under {', '.join(sorted(self.capacity_policies))}"
