"""pyalloc against PyTorch's native CUDA allocator, on a GPU, through torch.

``python -m benchmarks.gpu`` (``__main__.py``) runs each workload
(``workloads.py``) once per allocator, each in a fresh ``worker.py`` process,
finds the largest batch under a memory budget (``search.py``), and writes one
results file with its table and plots (``report.py``). See README.md.
"""
