"""kvtool: a test bench for LLM-inference KV cache connectors.

It bundles a model of a V2 paged KV cache manager (layer groups, pools, regions, a radix tree),
the connector runtime around it (three-phase ask/reserve/deliver scheduler, fake engine that
fingerprints KV bytes), transfer backends, and the `kvtool` command line.
"""

__version__ = "0.1.0"
