"""The connector API (names kept from the reference runtime) and the runtime side that drives it."""

from kvtool.connector.api import (
                                  HostStream,
                                  KvCacheConnectorScheduler,
                                  KvCacheConnectorWorker,
                                  RequestData,
                                  SchedulerOutput,
                                  valid_page_slots,
)
from kvtool.connector.llm_args import KvCacheConfig, KvCacheConnectorConfig, LayerGroupInfo, LlmArgs
from kvtool.connector.request import Request
from kvtool.group_pages import GroupPages

__all__ = ["GroupPages", "HostStream", "KvCacheConfig", "KvCacheConnectorConfig", "KvCacheConnectorScheduler",
           "KvCacheConnectorWorker", "LayerGroupInfo", "LlmArgs", "Request", "RequestData", "SchedulerOutput",
           "valid_page_slots"]
