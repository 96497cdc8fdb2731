"""ColossalAI's examples/images/resnet/train.py (hpcaitech/ColossalAI), followed step for step
with `shardwise` for `colossalai`: the same imports, plugins and their arguments (torch_ddp,
torch_ddp_fp16 through `Booster(mixed_precision="fp16")`, low_level_zero and gemini with
`initial_scale=2**5`), HybridAdam at the learning rate scaled by the world size, torch's
MultiStepLR, `booster.boost` with the criterion and scheduler, the checkpoints every
`--interval` epochs and `--resume`, and the evaluation with its all-reduce.

What differs, and why:
- CIFAR-10 is synthetic (random 32x32 images, labels from their mean colour, so there is
  something to learn): the test runs offline. `--num_samples`, `--batch_size` and `--epochs`
  make it small (the example: 50,000 images, batches of 100, 80 epochs).
- ResNet-18 is torchvision's when it is importable, else the same layers built here
  (torchvision is not a dependency of this project).
- `images.cuda()` is `.to(get_accelerator().get_current_device())`: the example's calls work
  only where CUDA is; on this CPU host the accelerator's device is the CPU.
- Each rank prints its epochs' mean losses as `epoch <e> loss <l>` for the test to read, where
  the example shows them in a tqdm bar on rank 0.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import MultiStepLR
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise.accelerator import get_accelerator
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from shardwise.booster.plugin.dp_plugin_base import DPPluginBase
from shardwise.cluster import DistCoordinator
from shardwise.nn.optimizer import HybridAdam

LEARNING_RATE = 1e-3


def resnet18(num_classes: int) -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=num_classes)
    except ImportError:
        return _ResNet18(num_classes)


class _Block(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class _ResNet18(nn.Module):
    """torchvision's resnet18 layers: a 7x7 stem, four stages of two basic blocks."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, inplanes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(
                nn.Sequential(_Block(inplanes, planes, stride), _Block(planes, planes, 1))
            )
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def synthetic_cifar10(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(num_samples, 3, 32, 32, generator=generator)
    labels = (images.mean(dim=(1, 2, 3)) * 10 % 10).long()
    return TensorDataset(images, labels)


def build_dataloader(batch_size: int, num_samples: int, plugin: DPPluginBase):
    train_dataset = synthetic_cifar10(num_samples, seed=0)
    test_dataset = synthetic_cifar10(num_samples // 2, seed=1)
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=batch_size, shuffle=True, drop_last=True
    )
    test_dataloader = plugin.prepare_dataloader(
        test_dataset, batch_size=batch_size, shuffle=False, drop_last=False
    )
    return train_dataloader, test_dataloader


@torch.no_grad()
def evaluate(model: nn.Module, test_dataloader: DataLoader, coordinator: DistCoordinator) -> float:
    model.eval()
    device = get_accelerator().get_current_device()
    correct = torch.zeros(1, dtype=torch.int64, device=device)
    total = torch.zeros(1, dtype=torch.int64, device=device)
    for images, labels in test_dataloader:
        images = images.to(device)
        labels = labels.to(device)
        outputs = model(images)
        _, predicted = torch.max(outputs.data, 1)
        total += labels.size(0)
        correct += (predicted == labels).sum().item()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    accuracy = correct.item() / total.item()
    if coordinator.is_master():
        print(f"Accuracy of the model on the test images: {accuracy * 100:.2f} %")
    return accuracy


def train_epoch(
    epoch: int,
    model: nn.Module,
    optimizer: Optimizer,
    criterion: nn.Module,
    train_dataloader: DataLoader,
    booster: Booster,
) -> None:
    model.train()
    device = get_accelerator().get_current_device()
    losses = []
    for images, labels in train_dataloader:
        images = images.to(device)
        labels = labels.to(device)
        outputs = model(images)
        loss = criterion(outputs, labels)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(f"epoch {epoch} loss {sum(losses) / len(losses):.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "-p",
        "--plugin",
        type=str,
        default="torch_ddp",
        choices=["torch_ddp", "torch_ddp_fp16", "low_level_zero", "gemini"],
    )
    parser.add_argument("-r", "--resume", type=int, default=-1)
    parser.add_argument("-c", "--checkpoint", type=str, default="./checkpoint")
    parser.add_argument("-i", "--interval", type=int, default=5)
    parser.add_argument("--target_acc", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--num_samples", type=int, default=50000)
    args = parser.parse_args()

    if args.interval > 0:
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)

    shardwise.launch_from_torch()
    coordinator = DistCoordinator()

    global LEARNING_RATE
    LEARNING_RATE *= coordinator.world_size

    booster_kwargs = {}
    if args.plugin == "torch_ddp_fp16":
        booster_kwargs["mixed_precision"] = "fp16"
    if args.plugin.startswith("torch_ddp"):
        plugin = TorchDDPPlugin()
    elif args.plugin == "gemini":
        plugin = GeminiPlugin(initial_scale=2**5)
    elif args.plugin == "low_level_zero":
        plugin = LowLevelZeroPlugin(initial_scale=2**5)

    booster = Booster(plugin=plugin, **booster_kwargs)

    train_dataloader, test_dataloader = build_dataloader(args.batch_size, args.num_samples, plugin)

    model = resnet18(num_classes=10)
    criterion = nn.CrossEntropyLoss()
    optimizer = HybridAdam(model.parameters(), lr=LEARNING_RATE)
    lr_scheduler = MultiStepLR(optimizer, milestones=[20, 40, 60, 80], gamma=1 / 3)

    model, optimizer, criterion, _, lr_scheduler = booster.boost(
        model, optimizer, criterion=criterion, lr_scheduler=lr_scheduler
    )

    if args.resume >= 0:
        booster.load_model(model, f"{args.checkpoint}/model_{args.resume}.pth")
        booster.load_optimizer(optimizer, f"{args.checkpoint}/optimizer_{args.resume}.pth")
        booster.load_lr_scheduler(lr_scheduler, f"{args.checkpoint}/lr_scheduler_{args.resume}.pth")

    start_epoch = args.resume if args.resume >= 0 else 0
    for epoch in range(start_epoch, args.epochs):
        train_epoch(epoch, model, optimizer, criterion, train_dataloader, booster)
        lr_scheduler.step()
        if args.interval > 0 and (epoch + 1) % args.interval == 0:
            booster.save_model(model, f"{args.checkpoint}/model_{epoch + 1}.pth")
            booster.save_optimizer(optimizer, f"{args.checkpoint}/optimizer_{epoch + 1}.pth")
            booster.save_lr_scheduler(
                lr_scheduler, f"{args.checkpoint}/lr_scheduler_{epoch + 1}.pth"
            )

    accuracy = evaluate(model, test_dataloader, coordinator)
    if args.target_acc is not None:
        assert accuracy >= args.target_acc, (
            f"Accuracy {accuracy} is lower than target accuracy {args.target_acc}"
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
