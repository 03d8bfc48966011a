"""``sslkit bench``: what a backbone is worth, compared with others on every protocol, from one feature cache."""

from sslkit.tools.bench.main import bench_finished_run, bench_main

__all__ = ["bench_finished_run", "bench_main"]
