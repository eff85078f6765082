"""install() with no arguments takes its settings from PYALLOC_CONF."""
import os

import torch

import pyalloc

pyalloc.install()
# The test may run under a base setting (strategy:bestfit): these keys come last.
assert os.environ["PYALLOC_CONF"].endswith("pool_size:48MiB,segment_size:4MiB"), os.environ["PYALLOC_CONF"]
x = torch.ones(10, device="cuda")
assert torch.cuda.memory_reserved() == 48 << 20
assert pyalloc._C.cuda_config()["segment_size"] == 4 << 20
print("OK")
