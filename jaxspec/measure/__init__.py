"""Measurement: the paper's analysis, benchmarks, step costs, the cost model, decode views
and task metrics. Nothing here is on the decoding path; launchers and scripts use it."""
