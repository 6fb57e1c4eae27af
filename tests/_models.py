"""Small models shared by the test modules that train them (imported by name: ``tests/`` is on sys.path under
pytest's default import mode, and a process-world worker puts a test module's directory there too)."""

from __future__ import annotations

import itertools

import torch
from torch import nn


def mlp(seed: int, dims: tuple[int, ...] = (5, 7, 3)) -> nn.Sequential:
    """A small MLP with seeded weights; by default dim-0 sizes 7 (uneven at W = 2, 3, 4) and 3 (uneven at
    W = 2, 4)."""
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        lin = nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) / a**0.5)
            lin.bias.copy_(torch.randn(b, generator=g) * 0.1)
        layers.append(lin)
        if i < len(dims) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)
