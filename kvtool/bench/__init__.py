"""`kvtool bench`: transfer and manager benchmarks, reported as ratios to a baseline of the same run."""
