"""`trainer.save_checkpoint` of a GPT-2 124M under Lightning on 2 ranks: shardwise's strategies
against Lightning's DDP and FSDP2 (`ModelParallelStrategy`, `fully_shard` per block), each
writing one whole checkpoint file (model and AdamW state) from rank 0.

    python benchmarks/bench_lightning_checkpoint.py --repeat 2 --out RESULT.json \
        [--results RESULTS.md]
    python benchmarks/bench_lightning_checkpoint.py --smoke                 (a tiny GPT-2)
    python benchmarks/bench_lightning_checkpoint.py --state-dict-type sharded \
        --strategies fsdp2 shardwise_fsdp shardwise_gemini     (each rank its shards)

Each strategy runs in a torchrun of its own, the strategies in turn, `--repeat` rounds
(Lightning keeps one strategy per process group): build the model from transformers' default
GPT-2 config (124M parameters, tied head; fp32), fit 3 steps (batch 1 of 64 tokens per rank,
AdamW), then time `trainer.save_checkpoint(path)` between barriers. Per strategy the fastest
round is kept (the host is shared: other load only adds time), with the worse rank's seconds,
the file's size, the mean time of the last 2 steps, for shardwise the chunks it built, and
each rank's peak resident set during the save above the one before it (the kernel's VmHWM,
reset through /proc/self/clear_refs: what the save holds on top of training; memory the
training freed and the allocator kept is reused first, so this is a lower bound).
`--state-dict-type sharded` saves each rank's shards instead: the shardwise strategies with
`state_dict_type="sharded"`, fsdp2 with `save_distributed_checkpoint=True`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 2**20
STRATEGIES = ("ddp", "fsdp2", "shardwise_fsdp", "shardwise_gemini")
STEPS, SEQ = 3, 64


def _config(smoke: bool) -> Any:
    from transformers import GPT2Config

    if smoke:
        return GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=SEQ)
    return GPT2Config()  # GPT-2 small: 124M parameters


def _module(smoke: bool, fully_shard_blocks: bool) -> Any:
    import pytorch_lightning as pl
    import torch
    from transformers import GPT2LMHeadModel

    class GPT2Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(_config(smoke))
            self.step_seconds: list[float] = []
            self._started = 0.0

        def configure_model(self) -> None:
            if not fully_shard_blocks:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def on_train_batch_start(self, *_: Any) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            self.step_seconds.append(time.perf_counter() - self._started)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            from torch.utils.data import DataLoader, TensorDataset

            generator = torch.Generator().manual_seed(0)
            vocab = self.model.config.vocab_size
            tokens = torch.randint(0, vocab, (STEPS * 2, SEQ), generator=generator)
            return DataLoader(TensorDataset(tokens), batch_size=1)

    return GPT2Module()


def reset_peak_rss() -> int:
    """Reset the kernel's peak resident set (VmHWM) to the current one; return it in bytes."""
    from bench_memory import _status_kib

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """The peak resident set since the last reset, in bytes."""
    from bench_memory import _status_kib

    return _status_kib("VmHWM") * 1024


def _strategy(name: str, state_dict_type: str) -> Any:
    if name == "fsdp2":
        from pytorch_lightning.strategies import ModelParallelStrategy

        return ModelParallelStrategy(save_distributed_checkpoint=state_dict_type == "sharded")
    if state_dict_type == "full":
        return name  # the registered name: the strategy's defaults
    if name == "ddp":
        raise ValueError("ddp has no sharded checkpoint: leave it out of --strategies")
    from shardwise_lightning import FullyShardedStrategy, GeminiStrategy

    if name == "shardwise_fsdp":
        return FullyShardedStrategy(state_dict_type="sharded")
    return GeminiStrategy(state_dict_type="sharded")


def _saved_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.resolve().rglob("*") if f.is_file())


def _remove(path: Path) -> None:
    from shardwise_lightning.checkpoint_paths import remove_sharded_checkpoint

    if path.is_symlink():
        remove_sharded_checkpoint(path)  # the link and the version directory it names
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)  # FSDP2's distributed checkpoint
    else:
        path.unlink(missing_ok=True)


def rank_main(
    strategy_name: str, directory: Path, smoke: bool, state_dict_type: str = "full"
) -> dict[str, Any]:
    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist

    import shardwise_lightning  # noqa: F401  (registers the strategy names)

    torch.set_num_threads(1)
    strategy = _strategy(strategy_name, state_dict_type)
    module = _module(smoke, fully_shard_blocks=strategy_name == "fsdp2")
    params = sum(p.numel() for p in module.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module)
        path = directory / f"{strategy_name}.ckpt"
        dist.barrier()
        before = reset_peak_rss()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        dist.barrier()
        seconds = time.perf_counter() - start
        growth = peak_rss() - before
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (seconds, growth))
    result: dict[str, Any] = {
        "params": params,
        "state_dict_type": state_dict_type,
        "save_seconds": max(s for s, _ in gathered),
        "save_rss_growth_mib": [round(growth / MIB) for _, growth in gathered],
        "step_seconds": sum(module.step_seconds[1:]) / max(1, len(module.step_seconds) - 1),
        "file_bytes": _saved_bytes(path) if dist.get_rank() == 0 else 0,
    }
    engine = getattr(trainer.strategy, "zero_model", None)
    if engine is not None:
        chunks = engine.chunk_manager.chunks
        result["chunks"] = len(chunks)
        result["largest_chunk_numel"] = max(chunk.numel for chunk in chunks)
    dist.barrier()  # every rank is done with the checkpoint before it goes
    if dist.get_rank() == 0:
        _remove(path)
    return result


def _run_one(strategy: str, smoke: bool, directory: Path, state_dict_type: str) -> dict[str, Any]:
    out = directory / f"{strategy}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(Path(__file__).resolve()),
        "--rank-of",
        strategy,
        "--dir",
        str(directory),
        "--state-dict-type",
        state_dict_type,
        *(["--smoke"] if smoke else []),
    ]
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


BLOCK = "bench_lightning_checkpoint"


def write_results(results: dict[str, Any], path: Path, command: str) -> None:
    """Replace the table of RESULTS.md's block (between its begin and end markers), keeping
    the notes written below the table."""
    from bench_memory import _write_block

    params = next(iter(results.values()))["params"]
    lines = [
        "## Lightning `trainer.save_checkpoint` of GPT-2 124M, one whole file (2 ranks)",
        "",
        f"Written by `{command}`: transformers' GPT-2 small ({params / 1e6:.0f}M parameters, "
        f"fp32, AdamW) fitted 3 steps (batch 1 x {SEQ} tokens per rank), then "
        f"`trainer.save_checkpoint` timed between barriers (the worse rank), each strategy in a "
        f"torchrun of its own, the strategies in turn, the fastest of the rounds kept (a host "
        f"shared with other work: its load only adds time). fsdp2 is Lightning's "
        f"`ModelParallelStrategy(save_distributed_checkpoint=False)` with `fully_shard` per "
        f'block; the shardwise strategies write their default `state_dict_type="full"`.',
        "",
        "| strategy | save (s) | file (MiB) | step (s) | chunks | largest chunk (elements) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, figures in results.items():
        chunks = figures.get("chunks", "")
        largest = figures.get("largest_chunk_numel")
        lines.append(
            f"| {name} | {figures['save_seconds']:.1f} | {figures['file_bytes'] / MIB:,.0f} | "
            f"{figures['step_seconds']:.2f} | {chunks} | "
            f"{f'{largest:,}' if largest else ''} |"
        )
    text = path.read_text() if path.exists() else ""
    _write_block(path, BLOCK, lines + _notes(text))


def _notes(text: str) -> list[str]:
    """The lines below the table in the block as it stands (the explanation of the figures)."""
    begin, end = text.find(f"<!-- {BLOCK}: begin -->"), text.find(f"<!-- {BLOCK}: end -->")
    if begin < 0 or end < begin:
        return []
    block = text[begin:end].splitlines()
    rows = [i for i, line in enumerate(block) if line.startswith("|")]
    return block[rows[-1] + 1 :] if rows else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT-2, seconds")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the strategies")
    parser.add_argument(
        "--state-dict-type",
        choices=("full", "sharded"),
        default="full",
        help="one file from rank 0 (full) or each rank its shards (sharded; not ddp)",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--results", type=Path, help="update this RESULTS.md block")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.results and args.state_dict_type == "sharded":
        parser.error(
            "--results writes the one-file table: run --state-dict-type sharded without it"
        )
    if not args.rank_of and args.state_dict_type == "sharded" and "ddp" in args.strategies:
        parser.error("ddp has no sharded checkpoint: leave it out of --strategies")
    if args.rank_of:
        result = rank_main(args.rank_of, args.dir, args.smoke, args.state_dict_type)
        if int(os.environ["RANK"]) == 0:
            (args.dir / f"{args.rank_of}.json").write_text(json.dumps(result))
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.repeat):
            for strategy in args.strategies:
                result = _run_one(strategy, args.smoke, Path(directory), args.state_dict_type)
                print(strategy, json.dumps(result), flush=True)
                best = results.get(strategy)
                if best is None or result["save_seconds"] < best["save_seconds"]:
                    results[strategy] = result
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    if args.results:
        command = (
            f"python benchmarks/bench_lightning_checkpoint.py --repeat {args.repeat} "
            f"--results benchmarks/RESULTS.md"
        )
        write_results(results, args.results, command)


if __name__ == "__main__":
    main()
