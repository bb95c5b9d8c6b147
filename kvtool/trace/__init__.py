"""The trace library: a workload replayed through the engine, manager and connector.

`setup` turns replay options into a built replay (manager config, connector, cost model, the
workload's requests; the GPU pool from `gpu_pool`, the GPU from `gpus`, the model's figures from
`model_compute`), `replay` runs it (`run_trace`: the engine over a request stream, a summary of
hit rates, TTFT and counts), `recorder` keeps per-request and per-iteration rows from the event
stream, `cost_model` prices a pass in simulated seconds, `load_check` says whether the engine kept
up, `tier_size` sets a tier against the GPU pool, `instances` spreads one workload over several
engines sharing a store, and `sweep_points` and `study` plan a capacity sweep and say what it
recommends. The commands in `kvtool.cli.trace*` are thin faces over it.
"""
