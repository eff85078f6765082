"""pyalloc's benchmarks: ``bench_core.py`` (the C++ hot path), ``bench_oom_watch.py`` (what
watching for out-of-memory errors costs) and ``gpu/`` (torch on a GPU).

A regular package, so that ``python -m benchmarks.gpu`` finds this directory
even when some installed distribution also ships a top-level ``benchmarks``.
"""
