"""The reference networks of the field's image metrics, under the names of the files users have:
torchvision's VGG16 (the improved precision and recall's features, LANTERN's ``eval_prec_recall.py``)
and pytorch-fid's FID Inception (TensorFlow's 2015-12-05 graph, the FIDs papers report). Written
here because torchvision does not import beside every torch build; checked against torchvision's
and pytorch-fid's own code (tests/data, scripts/make_*_reference.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# torchvision's VGG16 (configuration "D"): the channels of each 3x3 convolution, "M" a 2x2 max pool.
VGG16_LAYERS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

class Vgg16(nn.Module):
    """torchvision's ``models.vgg16()`` under its own names (``features.N``, ``classifier.N``), so
    its ImageNet file loads as it is."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in VGG16_LAYERS:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(channels, int(item), 3, padding=1), nn.ReLU(inplace=True)]
                channels = int(item)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                                        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                                        nn.Linear(4096, 1000))  # the ImageNet head: in the file, unused here

    def fc2_features(self, x: Tensor) -> Tensor:
        """``classifier[:4](features(x).flatten(1))`` in eval mode, for ImageNet-normalised 224 x 224
        images: fc1, ReLU, dropout (none at inference), fc2, whose ReLU is not taken."""
        fc1, fc2 = self.classifier[0], self.classifier[3]
        return fc2(F.relu(fc1(self.features(x).flatten(1))))


class _Conv(nn.Module):
    """torchvision's BasicConv2d: a convolution without bias, batch norm (eps 0.001), ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
                 padding: int | tuple[int, int] = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


def _tf_avg_pool(x: Tensor) -> Tensor:
    """TensorFlow's 3x3 average pool, which leaves the padding out of the average (the FID patch)."""
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class _MixedA(nn.Module):  # torchvision's InceptionA, as pytorch-fid's FIDInceptionA runs it
    def __init__(self, cin: int, pool: int) -> None:
        super().__init__()
        self.branch1x1 = _Conv(cin, 64, 1)
        self.branch5x5_1, self.branch5x5_2 = _Conv(cin, 48, 1), _Conv(48, 64, 5, padding=2)
        self.branch3x3dbl_1, self.branch3x3dbl_2 = _Conv(cin, 64, 1), _Conv(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = _Conv(96, 96, 3, padding=1)
        self.branch_pool = _Conv(cin, pool, 1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
                          self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                          self.branch_pool(_tf_avg_pool(x))], 1)


class _MixedB(nn.Module):  # torchvision's InceptionB (unpatched)
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = _Conv(cin, 384, 3, stride=2)
        self.branch3x3dbl_1, self.branch3x3dbl_2 = _Conv(cin, 64, 1), _Conv(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = _Conv(96, 96, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch3x3(x), self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                          F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class _MixedC(nn.Module):  # torchvision's InceptionC, as FIDInceptionC runs it
    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = _Conv(cin, 192, 1)
        self.branch7x7_1, self.branch7x7_2 = _Conv(cin, c7, 1), _Conv(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = _Conv(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1, self.branch7x7dbl_2 = _Conv(cin, c7, 1), _Conv(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3, self.branch7x7dbl_4 = _Conv(c7, c7, (1, 7), padding=(0, 3)), _Conv(c7, c7, (7, 1),
                                                                                                  padding=(3, 0))
        self.branch7x7dbl_5 = _Conv(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = _Conv(cin, 192, 1)

    def forward(self, x: Tensor) -> Tensor:
        seven = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        double = self.branch7x7dbl_1(x)
        for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            double = layer(double)
        return torch.cat([self.branch1x1(x), seven, double, self.branch_pool(_tf_avg_pool(x))], 1)


class _MixedD(nn.Module):  # torchvision's InceptionD (unpatched)
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3_1, self.branch3x3_2 = _Conv(cin, 192, 1), _Conv(192, 320, 3, stride=2)
        self.branch7x7x3_1, self.branch7x7x3_2 = _Conv(cin, 192, 1), _Conv(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3, self.branch7x7x3_4 = _Conv(192, 192, (7, 1), padding=(3, 0)), _Conv(192, 192, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        seven = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), seven, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class _MixedE(nn.Module):  # torchvision's InceptionE, as FIDInceptionE_1 (average pool) / _2 (max pool) run it
    def __init__(self, cin: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool  # the FID network's last block pools by max: a quirk of its TensorFlow graph
        self.branch1x1 = _Conv(cin, 320, 1)
        self.branch3x3_1 = _Conv(cin, 384, 1)
        self.branch3x3_2a, self.branch3x3_2b = _Conv(384, 384, (1, 3), padding=(0, 1)), _Conv(384, 384, (3, 1),
                                                                                                padding=(1, 0))
        self.branch3x3dbl_1, self.branch3x3dbl_2 = _Conv(cin, 448, 1), _Conv(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = _Conv(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = _Conv(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = _Conv(cin, 192, 1)

    def forward(self, x: Tensor) -> Tensor:
        three = self.branch3x3_1(x)
        double = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool else _tf_avg_pool(x)
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(three), self.branch3x3_2b(three),
                          self.branch3x3dbl_3a(double), self.branch3x3dbl_3b(double), self.branch_pool(pooled)], 1)


class FidInceptionV3(nn.Module):
    """pytorch-fid's ``fid_inception_v3()``: torchvision's Inception3 layout (``Conv2d_1a_3x3``,
    ``Mixed_5b``, ...; ``fc`` to 1008 classes, unused) with the FID blocks' TensorFlow pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3, self.Conv2d_2a_3x3 = _Conv(3, 32, 3, stride=2), _Conv(32, 32, 3)
        self.Conv2d_2b_3x3, self.Conv2d_3b_1x1 = _Conv(32, 64, 3, padding=1), _Conv(64, 80, 1)
        self.Conv2d_4a_3x3 = _Conv(80, 192, 3)
        self.Mixed_5b, self.Mixed_5c, self.Mixed_5d = _MixedA(192, 32), _MixedA(256, 64), _MixedA(288, 64)
        self.Mixed_6a = _MixedB(288)
        self.Mixed_6b, self.Mixed_6c = _MixedC(768, 128), _MixedC(768, 160)
        self.Mixed_6d, self.Mixed_6e = _MixedC(768, 160), _MixedC(768, 192)
        self.Mixed_7a, self.Mixed_7b, self.Mixed_7c = _MixedD(768), _MixedE(1280, False), _MixedE(2048, True)
        self.fc = nn.Linear(2048, 1008)

    def pool_features(self, x: Tensor) -> Tensor:
        """The 2048-d final average pool of images in [-1, 1] at 299 x 299."""
        for layer in (self.Conv2d_1a_3x3, self.Conv2d_2a_3x3, self.Conv2d_2b_3x3):
            x = layer(x)
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), kernel_size=3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c,
                      self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        return x.mean((2, 3))
