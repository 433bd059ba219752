"""ResNet-18 and MobileNetV2 for 32x32 images, defined here so that a board needs no torchvision.

The modules mirror torchvision's (``torchvision.models.resnet18`` with a CIFAR stem,
``torchvision.models.mobilenet_v2`` with a stride-1 stem): the same layers in the same order,
under the same attribute names, so parameter names, shapes and the forward pass are torchvision's
(``tests/test_models.py`` loads one into the other and compares outputs where torchvision is
installed), and the same initialisation rules (He for convolutions, BatchNorm at 1 and 0;
MobileNetV2's classifier N(0, 0.01)). torchvision's PyPI wheels pin one torch release each, so a
board that needed it could not keep the torch its vendor ships (NVIDIA's for a Jetson).
"""

from __future__ import annotations

from torch import nn

NamedBlocks = list[tuple[str, nn.Module]]


# --- ResNet-18 ------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (torchvision's BasicBlock)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def _resnet_layer(inplanes: int, planes: int, blocks: int, stride: int) -> list[BasicBlock]:
    downsample = None
    if stride != 1 or inplanes != planes:
        downsample = nn.Sequential(nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False),
                                   nn.BatchNorm2d(planes))
    return [BasicBlock(inplanes, planes, stride, downsample)] + [BasicBlock(planes, planes) for _ in range(1, blocks)]


def resnet18_blocks(num_classes: int) -> NamedBlocks:
    """ResNet-18 with the CIFAR stem (a 3x3 stride-1 convolution, no max-pool), as named blocks:
    ``stem``, ``layer1.0`` ... ``layer4.1``, ``head``."""
    stem = nn.Sequential(nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False), nn.BatchNorm2d(64),
                         nn.ReLU(inplace=True))
    blocks: NamedBlocks = [("stem", stem)]
    inplanes = 64
    for index, (planes, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
        layer = _resnet_layer(inplanes, planes, 2, stride)
        blocks += [(f"layer{index}.{i}", block) for i, block in enumerate(layer)]
        inplanes = planes
    blocks.append(("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))))
    for _, block in blocks:
        for m in block.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
    return blocks


# --- MobileNetV2 ----------------------------------------------------------------------------------

def conv_bn_relu6(inp: int, oup: int, kernel_size: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """Convolution, BatchNorm, ReLU6 (torchvision's Conv2dNormActivation as MobileNetV2 uses it)."""
    return nn.Sequential(nn.Conv2d(inp, oup, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(oup), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1), with a residual when shapes allow
    (torchvision's InvertedResidual)."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        self.stride = stride
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = [conv_bn_relu6(inp, hidden, kernel_size=1)] if expand_ratio != 1 else []
        layers += [conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, oup, 1, 1, 0, bias=False), nn.BatchNorm2d(oup)]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


MOBILENET_V2_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                        (6, 320, 1, 1))
"""(expansion t, output channels c, repeats n, first stride s) of each stage (width 1.0)."""


def mobilenet_v2_blocks(num_classes: int) -> NamedBlocks:
    """MobileNetV2 (width 1.0) with a stride-1 stem convolution, so 32x32 inputs keep enough
    resolution, as named blocks: ``features.0`` ... ``features.18``, ``head``."""
    features: list[nn.Module] = [conv_bn_relu6(3, 32, stride=1)]
    channels = 32
    for t, c, n, s in MOBILENET_V2_SETTING:
        for i in range(n):
            features.append(InvertedResidual(channels, c, s if i == 0 else 1, t))
            channels = c
    features.append(conv_bn_relu6(channels, 1280, kernel_size=1))
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Sequential(nn.Dropout(p=0.2),
                                                                              nn.Linear(1280, num_classes)))
    blocks: NamedBlocks = [(f"features.{i}", f) for i, f in enumerate(features)] + [("head", head)]
    for _, block in blocks:
        for m in block.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)
    return blocks
