"""The smallest multilayer perceptron (Linear(4, 8), relu, Linear(8, 3)),
shared by the `.pte` fixtures (`scripts/make_pte_fixtures.py`) and the
dynamic-batch modules (`dynamic_modules.py`)."""

import torch


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
