"""The trace library: a workload replayed through the engine, manager and connector.

`setup` turns replay options into a built replay (manager config, connector, cost model, the
workload's requests), `replay` runs it (`run_trace`: the engine over a request stream, a summary of
hit rates, TTFT and counts), `recorder` keeps per-request and per-iteration rows from the event
stream, `cost_model` prices a pass in simulated seconds, and `instances` spreads one workload over
several engines sharing a store. The commands in `kvtool.cli.trace*` are thin faces over it.
"""
