"""install() with no arguments takes its settings from PYALLOC_CONF."""
import os

import torch

import pyalloc

pyalloc.install()
assert os.environ["PYALLOC_CONF"] == "pool_size:48MiB,segment_size:4MiB"
x = torch.ones(10, device="cuda")
assert torch.cuda.memory_reserved() == 48 << 20
assert pyalloc._C.cuda_config()["segment_size"] == 4 << 20
print("OK")
