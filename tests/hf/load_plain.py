"""A plain process, without shardwise: load the saved checkpoints with from_pretrained and print
the largest logits difference to the trained model's, per checkpoint, as JSON.

    python tests/hf/load_plain.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

VOCAB, SEQ = 96, 16  # as in trainer_support.py
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    found: dict[str, object] = {}
    for kind in ("llama", "gpt2"):
        trained = torch.load(out / kind / "logits.pt")
        for name in ("final", "final_split"):
            if not (out / kind / name).exists():
                continue
            model = AutoModelForCausalLM.from_pretrained(str(out / kind / name)).eval()
            with torch.no_grad():
                logits = model(input_ids=PROBE).logits.float()
            found[f"{kind}/{name}"] = float((logits - trained).abs().max())
    found["shardwise_imported"] = any(m.startswith("shardwise") for m in sys.modules)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
