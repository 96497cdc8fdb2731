"""fp16 ResNet-18, the default precision of ColossalAI's examples/images/resnet/train.py
(`LowLevelZeroPlugin(initial_scale=2**5)` / `GeminiPlugin(initial_scale=2**5)`, HybridAdam),
against fp32 and against torch autocast fp16 with a gradient scaler, on 2 CPU ranks.

[Note: fp16 ResNet against fp32]
The engine's fp16 losses were reported 26% away from the fp32 run's at an early step. Measured
here (ResNet-18 as torchvision builds it, 4 random 32x32 images per rank, HybridAdam lr 2e-3):
- Before any update the fp16 run's loss is within 0.1% of fp32's (seed 0: 2.7177 against
  2.7163; autocast 2.7109): storing the weights in fp16 costs the forward almost nothing.
- The engine's fp16 path is exactly the mixed-precision recipe a user writes by hand (fp16
  weights, a rounded copy of fp32 master weights; the loss scaled; gradients cast to fp16 and
  averaged over the ranks in fp16; unscaled into the fp32 masters that Adam steps; on a CPU the
  arithmetic in fp32): equal to that loop bit for bit, LowLevelZero and Gemini alike, with no
  step skipped and no gradient flushed to zero at this scale.
- From the first update on, both fp16 runs leave the fp32 run by the same order of magnitude:
  at the steps after the first, seeds 0-4 put the engine 1-24% and autocast 1-23% away from
  fp32 (seed 0, step 1: engine 3.2481, autocast 2.9737, fp32 2.9910; step 2: engine 3.1808,
  autocast 3.3717, fp32 3.1521). Adam's first steps move every weight by about the learning
  rate in the direction of its gradient's sign, and fp16 flips the sign of 1.7% (fp16 weights)
  to 2.4% (autocast) of the gradient elements of step 0 against fp32; BatchNorm over 4 samples
  (1x1 maps in the last stage) then amplifies the different weights. Neither fp16 run is the
  fp32 run, and neither is wrong: the gap is the training's sensitivity, not the engine's fp16
  path. On CUDA the engine also computes in fp16, BatchNorm included, as ColossalAI's fp16
  (`model.half()`) does, where autocast keeps BatchNorm and the loss in fp32.

So the test pins: the engine equals the hand-written fp16 loop bit for bit (the acceptance
test); the first forward is within 0.2% of fp32 for the engine and for autocast; and autocast,
the reference for "fp16 done right", also leaves fp32 by more than 1% within the first steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from shardwise.nn.optimizer import HybridAdam
from shardwise.testing import run_ranks

STEPS = 3
BATCH_PER_RANK = 4
LR = 1e-3 * 2  # the example's linear scaling to 2 ranks
INITIAL_SCALE = 2**5  # the example's


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18(num_classes=10): its layers and initialisation."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = ((64, 1), (128, 2), (256, 2), (512, 2))
        stages, inplanes = [], 64
        for planes, stride in widths:
            stages.append(
                nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes, 1))
            )
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _model() -> ResNet18:
    torch.manual_seed(0)
    return ResNet18()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    images = torch.rand(BATCH_PER_RANK, 3, 32, 32, generator=generator)
    return images, torch.randint(0, 10, (BATCH_PER_RANK,), generator=generator)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _engine(plugin_name: str) -> list[float]:
    plugin = (
        GeminiPlugin(initial_scale=INITIAL_SCALE)
        if plugin_name == "gemini"
        else LowLevelZeroPlugin(initial_scale=INITIAL_SCALE)
    )
    booster = Booster(plugin=plugin)
    module = _model()
    optimizer = HybridAdam(module.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    model, optimizer, criterion, *_ = booster.boost(module, optimizer, criterion=criterion)
    losses = []
    for step in range(STEPS):
        images, labels = _batch(step)
        loss = criterion(model(images), labels)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return losses


def _hand_written_fp16() -> list[float]:
    """Mixed precision written out: fp16 weights (the forward reads them, in fp32 arithmetic
    on a CPU), fp32 masters stepped by Adam, a static loss scale, fp16 gradients averaged."""
    model = _model()
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    optimizer = HybridAdam(masters, lr=LR)
    criterion = nn.CrossEntropyLoss()

    def publish() -> None:
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters, strict=True):
                param.copy_(master.half().float())

    publish()
    losses = []
    for step in range(STEPS):
        images, labels = _batch(step)
        loss = criterion(model(images), labels)
        (loss * INITIAL_SCALE).backward()
        for param, master in zip(model.parameters(), masters, strict=True):
            assert param.grad is not None
            grad = param.grad.half() / dist.get_world_size()
            dist.all_reduce(grad)
            master.grad = grad.float() / INITIAL_SCALE
            param.grad = None
        optimizer.step()
        optimizer.zero_grad()
        publish()
        losses.append(_mean_over_ranks(loss))
    return losses


def _ddp(autocast: bool) -> list[float]:
    """The resnet example's torch_ddp / torch_ddp_fp16: DDP, with autocast and a gradient
    scaler for fp16 (the example's Booster(mixed_precision="fp16") over TorchDDPPlugin)."""
    model = nn.parallel.DistributedDataParallel(_model())
    optimizer = HybridAdam(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE) if autocast else None
    losses = []
    for step in range(STEPS):
        images, labels = _batch(step)
        if scaler is not None:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = criterion(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return losses


def _all_runs() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "low_level_zero": _engine("low_level_zero"),
        "gemini": _engine("gemini"),
        "hand_written_fp16": _hand_written_fp16(),
        "fp32": _ddp(autocast=False),
        "autocast_fp16": _ddp(autocast=True),
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return run_ranks(_all_runs, 2, timeout_s=300)[0]


def test_fp16_engine_equals_the_hand_written_mixed_precision_loop(runs: dict[str, Any]) -> None:
    assert runs["low_level_zero"] == runs["hand_written_fp16"]
    assert runs["gemini"] == runs["hand_written_fp16"]


def test_fp16_forward_is_fp32_within_rounding_and_training_then_departs(
    runs: dict[str, Any],
) -> None:
    fp32 = runs["fp32"]
    for name in ("low_level_zero", "autocast_fp16"):
        # Before any update: the fp16 weights (engine) or fp16 arithmetic (autocast) alone.
        assert abs(runs[name][0] - fp32[0]) / fp32[0] < 2e-3, (name, runs[name], fp32)
    # After the first update both fp16 runs have left fp32 (see [Note: fp16 ResNet against
    # fp32]): the reference for fp16 done right departs too, so the engine's gap is no defect.
    departures = {
        name: max(abs(a - b) / b for a, b in zip(runs[name][1:], fp32[1:], strict=True))
        for name in ("low_level_zero", "autocast_fp16")
    }
    assert all(gap > 0.01 for gap in departures.values()), departures
