"""Reading torch checkpoint files (`torch.save`'s), shared by the checkpoint readers and the
lazy `from_pretrained`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_torch_file(path: Path) -> Any:
    """A torch checkpoint file, memory-mapped where its format allows (only the pages read are
    loaded), tensors on the CPU; plain Python values only, never arbitrary objects."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        # The legacy (non-zip) format cannot be mapped.
        return torch.load(path, map_location="cpu", weights_only=True)
