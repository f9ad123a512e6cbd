"""Image classifiers of the torchvision kind, written out (torchvision is not
in the venv): a ResNet-18-style net (stem 7x7/2 conv + batch norm + max pool,
four stages of two residual basic blocks, adaptive average pool, linear head)
and a MobileNetV2 (stem conv, inverted residuals with depthwise 3x3 convs and
relu6, 1x1 head conv, average pool, linear classifier). Random weights; batch
norms get random running stats so that eval mode does real work. `width`
scales every channel count: 1.0 is torchvision's, CI uses a fraction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def random_bn(module: nn.Module) -> nn.Module:
    """Non-trivial eval-mode batch norms, with variance ~1 so activations stay O(1)."""
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.8, 1.2)
                m.weight.uniform_(0.6, 1.0)
                m.bias.uniform_(-0.2, 0.2)
    return module


def conv_bn(cin, cout, k, stride=1, groups=1, act=None):
    # activations in place, as torchvision's (`relu_`, `hardtanh_` in the export)
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act(inplace=True)] if act else []))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, cout, 3, stride, act=nn.ReLU), conv_bn(cout, cout, 3))
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        out = self.body(x)
        out += self.down(x)  # in place, as torchvision's block
        return F.relu(out, inplace=True)


class ResNet(nn.Module):
    """torchvision resnet18's layout; `width=1.0` gives its 64..512 channels."""

    def __init__(self, width: float = 1.0, classes: int = 1000, blocks=(2, 2, 2, 2)):
        super().__init__()
        c = [max(8, int(64 * width * 2**i)) for i in range(4)]
        self.stem = nn.Sequential(conv_bn(3, c[0], 7, 2, act=nn.ReLU), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], c[0]
        for i, (cout, n) in enumerate(zip(c, blocks)):
            for j in range(n):
                stages.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)
        random_bn(self)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn(cin, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6), conv_bn(hidden, cout, 1)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


# torchvision's MobileNetV2 settings: expansion t, channels c, repeats n, stride s.
MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def _div8(v: float) -> int:
    return max(8, int(v + 4) // 8 * 8)


class MobileNetV2(nn.Module):
    def __init__(self, width: float = 1.0, classes: int = 1000):
        super().__init__()
        cin = _div8(32 * width)
        layers = [conv_bn(3, cin, 3, 2, act=nn.ReLU6)]
        for t, c, n, s in MOBILENET_V2:
            cout = _div8(c * width)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        last = _div8(1280 * max(1.0, width))
        layers.append(conv_bn(cin, last, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(last, classes)
        random_bn(self)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))
