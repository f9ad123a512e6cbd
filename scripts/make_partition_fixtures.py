"""Write the tiny .pt2 fixtures of the Metal partitioner tests into
crates/etmetal-metal/tests/fixtures/ (no Python needed by `cargo test`).

Run with the project venv:
/root/.cache/etmetal/venv/bin/python scripts/make_partition_fixtures.py
"""
import os

import torch
import torch.nn as nn

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..", "crates", "etmetal-metal", "tests", "fixtures",
)


class Add(nn.Module):
    def forward(self, x, y):
        return x + y


class AddRelu(nn.Module):
    def forward(self, x):
        return torch.relu(x + 1.0)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    fixtures = [
        ("add", Add(), (torch.randn(2, 3), torch.randn(2, 3))),
        ("linear", nn.Linear(10, 5), (torch.randn(3, 10),)),
        ("add_relu", AddRelu(), (torch.randn(4),)),
    ]
    for name, module, args in fixtures:
        ep = torch.export.export(module.eval(), args)
        torch.export.save(ep, os.path.join(OUT, name + ".pt2"))
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote fixtures: {total} bytes in {OUT}")


if __name__ == "__main__":
    main()
