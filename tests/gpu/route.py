"""install() with no arguments takes the route PYALLOC_BRIDGE selects: prints it, and
the first line of any warning install() gave (the hooks route's fallback warning)."""
import warnings

import torch

import pyalloc

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pyalloc.install()
print("ROUTE", pyalloc.is_installed())
for w in caught:
    print("WARNING", str(w.message).splitlines()[0])
x = torch.ones(1000, device="cuda")
assert torch.cuda.memory_allocated() == pyalloc.memory_allocated() >= 4000
print("OK")
