"""A connector whose process dies at its first ask (os._exit, as a segfault or the OOM killer
would end it): what a parent of engine processes must notice rather than wait for forever."""

from __future__ import annotations

import os

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker

__all__ = ["DiesAtAsk", "HostConnectorWorker"]


class DiesAtAsk(HostConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        os._exit(7)
