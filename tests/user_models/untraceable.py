"""A model that branches on tensor values: no front door can capture it."""

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent: the graph would change from batch to batch
            return y
        return -y


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.mlp = nn.Linear(hidden, hidden)
        self.gate = Gate(hidden)

    def forward(self, x):
        return self.gate(self.mlp(x))


class Untraceable(nn.Module):
    def __init__(self, vocab=32, hidden=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
