"""A small convnet trained with torch.backends.cudnn.benchmark = True (the bridge only).

In benchmark mode cuDNN sizes the workspaces of the algorithms it tries with the
allocator's cacheInfo, which the C hooks route answers with "not supported", so
there every convolution fails; through the bridge the convnet trains. Two input
sizes, so that cuDNN benchmarks each, and channels-last half precision besides.
"""
import math

import torch
import torch.nn.functional as F

import pyalloc
from gpu_common import bridge_only


def convnet():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, stride=2, padding=1, groups=4), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 10),
    ).cuda()


def train(model, batches, steps, autocast=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    bridge_only("torch.backends.cudnn.benchmark = True (cuDNN asks the allocator's cacheInfo)")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(1)
    # Two resolutions, each memorised: the loss on each must fall.
    batches = [(torch.randn(64, 3, side, side, device="cuda", generator=g),
                torch.randint(0, 10, (64,), device="cuda", generator=g)) for side in (32, 48)]

    losses = train(convnet(), batches, steps=40)
    assert all(math.isfinite(v) for v in losses), losses
    for first in (0, 1):  # each resolution's first and last loss
        mine = losses[first::2]
        assert mine[-1] < 0.7 * mine[0], (first, mine)

    model = convnet().to(memory_format=torch.channels_last)
    half = [(x.to(memory_format=torch.channels_last), y) for x, y in batches]
    losses = train(model, half, steps=20, autocast=True)
    assert all(math.isfinite(v) for v in losses), losses

    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()  # torch's own, answered by the bridge
    assert stats["allocation.all.current"] == pyalloc.memory_stats()["allocation.all.current"]
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
