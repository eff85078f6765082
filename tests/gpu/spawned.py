"""Run by `pyalloc run` (see test_gpu.py): the processes the program starts with
spawn (torch.multiprocessing.spawn, as DDP without torchrun) and forkserver get
pyalloc, with the program's settings and route, before their first CUDA work.

    spawned.py EXPECTED_POOL_SIZE
"""
import sys

import torch
import torch.multiprocessing as mp

import pyalloc


def report(rank, queue):
    installed = pyalloc.is_installed()  # before any CUDA work of this process
    x = torch.ones(1 << 20, device="cuda")
    queue.put((installed, pyalloc._C.cuda_config()["pool_size"], pyalloc.memory_allocated() >= x.numel() * 4))


def through(method, pool_size):
    queue = mp.get_context(method).SimpleQueue()
    if method == "spawn":
        mp.spawn(report, args=(queue,), nprocs=1)
    else:
        p = mp.get_context(method).Process(target=report, args=(0, queue))
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
    got = queue.get()
    assert got == (pyalloc.is_installed(), pool_size, True), (method, got)


if __name__ == "__main__":
    assert pyalloc.is_installed() and not torch.cuda.is_initialized()
    pool_size = int(sys.argv[1])
    for method in ("spawn", "forkserver"):
        through(method, pool_size)
    print("OK")
