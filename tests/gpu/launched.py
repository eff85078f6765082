"""Run by `pyalloc run` (see test_gpu.py): pyalloc is installed before this line.

    launched.py EXPECTED_POOL_SIZE arg...
"""
import sys

import torch

import pyalloc

assert __name__ == "__main__", __name__
assert pyalloc.is_installed()
assert not torch.cuda.is_initialized()
pool_size = int(sys.argv[1])
x = torch.ones(1000, device="cuda")
assert torch.cuda.memory_reserved() >= pool_size  # the settings reached the pool
assert torch.cuda.memory_allocated() >= 4096
assert pyalloc._C.cuda_config()["pool_size"] == pool_size
print("ARGV", sys.argv[2:])
print("OK")
