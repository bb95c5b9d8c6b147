"""kvtool's reference connectors, usable as templates: `host` (pinned host memory, LRU) and
`disk` (files published atomically, checksummed). Both share the block-store scheduler."""
