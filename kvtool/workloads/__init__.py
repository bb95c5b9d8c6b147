"""Request workloads: kvtool's JSON Lines, published traces (Mooncake, Bailian), token synthesis
from block ids, and generators for workloads nobody publishes. Everything streams: a request is
read when the replay needs it."""
