"""Trains a small model for a few steps and prints its losses, bit for bit.

    python train.py --allocator native|pyalloc [--steps N]

Run once with each allocator (same seeds, deterministic kernels): the losses
must be identical, since where memory lives must not change any result.
Needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment for deterministic cuBLAS.
"""
import argparse
import json

import torch

import pyalloc


def make_data(steps, batch=64):
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(steps, batch, 3, 16, 16, generator=g)
    ys = torch.randint(0, 10, (steps, batch), generator=g)
    return xs, ys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocator", choices=("native", "pyalloc"), required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.allocator == "pyalloc":
        pyalloc.install()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs, ys = make_data(args.steps)
    losses = []
    for step in range(args.steps):
        x, y = xs[step].cuda(non_blocking=True), ys[step].cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    if args.allocator == "pyalloc":
        route = pyalloc.is_installed()
        assert route in ("bridge", "hooks"), route
        # Libraries that log memory keep working: torch.cuda answers from pyalloc, through
        # torch's own functions on the bridge route and pyalloc's in their place on the hooks.
        assert torch.cuda.memory_allocated() == pyalloc.memory_allocated() > 0
        title = "PyTorch CUDA memory summary" if route == "bridge" else "pyalloc CUDA memory summary"
        assert title in torch.cuda.memory_summary(), torch.cuda.memory_summary()
    print(json.dumps(losses))


if __name__ == "__main__":
    main()
