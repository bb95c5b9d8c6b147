"""Studies of kvtool itself (replay speed, the link study, kernel tuning, rank overhead).

Not part of the installed package: run them from the repository root, `python -m benchmarks.NAME`.
"""
