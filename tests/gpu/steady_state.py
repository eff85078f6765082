"""A fixed-shape training loop calls the driver never once warm: over 50 steps
after the warm-up, pyalloc's num_device_alloc and num_device_free (segments
reserved and released, pages mapped and unmapped) do not change.

    python steady_state.py [--warmup N] [--steps N]

Run under each strategy by test_gpu.py (PYALLOC_CONF=strategy:...).
"""
import argparse
import json

import torch

import pyalloc


def device_calls():
    st = pyalloc.memory_stats(0)
    return st["num_device_alloc"], st["num_device_free"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    pyalloc.install()
    strategy = pyalloc._C.cuda_config()["strategy"]

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(64 * 16 * 16, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10),
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.warmup):  # the optimizer's state, cuBLAS's workspace, ...
        step()
    torch.cuda.synchronize()
    history = [device_calls()]
    for _ in range(args.steps):
        loss = step()
        history.append(device_calls())
    torch.cuda.synchronize()
    assert torch.isfinite(loss).item()
    print(json.dumps({"strategy": strategy, "after_warmup": history[0], "after_steps": history[-1]}))
    assert history[-1] == history[0], (strategy, history)
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
