"""A 2-rank DDP job: run by torchrun, each rank with pyalloc on its own device.

    torchrun --nproc-per-node=2 -m pyalloc run ddp.py        (the launcher installs)
    PYALLOC_CONF=... torchrun --nproc-per-node=2 ddp.py --install   (the script does)

With one GPU both ranks share it over gloo; with two or more, NCCL.
"""
import os
import sys

import torch
import torch.distributed as dist

import pyalloc


def main():
    if "--install" in sys.argv:
        pyalloc.install()
    assert pyalloc.is_installed()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    device = int(os.environ["LOCAL_RANK"]) % gpus
    torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpus >= world else "gloo")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(32, 64, generator=g).cuda()
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    # Every rank holds the same parameters after synchronised steps.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)  # all_reduce: on GPU under gloo and NCCL
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    assert torch.equal(low, high), "ranks diverged"
    assert pyalloc.memory_allocated(device) > 0
    assert torch.cuda.memory_allocated(device) == pyalloc.memory_allocated(device)
    conf_pool = pyalloc._C.cuda_config()["pool_size"]
    if conf_pool:
        assert torch.cuda.memory_reserved(device) >= conf_pool
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} OK on cuda:{device}")


if __name__ == "__main__":
    main()
