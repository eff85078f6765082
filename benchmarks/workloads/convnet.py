"""A small convolutional network trained with SGD on random images whose side
and batch size change every step (multi-resolution training): convolution
buffers and activations of a new size each step.

    pyalloc record -o benchmarks/traces/convnet-mixedres-train.pickle.gz -- \
        python benchmarks/workloads/convnet.py
"""
import argparse
import random

import torch
from torch import nn
from torch.nn import functional as F


def conv_block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class ConvNet(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 16), conv_block(16, 32), conv_block(32, 64))
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    shapes = random.Random(args.seed)
    classes = 10
    model = ConvNet(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(args.steps):
        batch, side = shapes.randint(4, 16), shapes.randrange(32, 129, 16)
        images = torch.randn(batch, 3, side, side)
        labels = torch.randint(classes, (batch,))
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
