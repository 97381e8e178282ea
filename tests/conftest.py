"""Shared by the tests: the repository root on sys.path, and a helper to randomise tiny models."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def randomize(module, seed, std):
    """Re-draw every matrix with N(0, std^2) and every vector (norm gains) around 1, so that the
    model is far from its near-uniform init and greedy outputs vary."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
            else:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module
