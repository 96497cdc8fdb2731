"""ColossalAI's example scripts (their ports beside this file, each naming its source and every
change) run on 2 CPU ranks as torchrun would start them: each plan the example offers, to its
end, with its losses finite; beyond a smoke test, a run resumed from the ResNet example's
checkpoint continues exactly as the run that was not stopped, and the GLUE example's ZeRO
plugins (fp16 storage) track its fp32 DDP run.

The ranks are forked from this process (forked_script.py), which imports what the scripts
import first, so a run takes about a second (ResNet-18 in fp16 on a CPU: several)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import transformers
from forked_script import RankOutput, run_script

import shardwise.booster  # imported before the forks, as the docstring says
import shardwise.zero  # noqa: F401

# transformers imports its model classes lazily: once here, not in every rank.
_ = (transformers.BertForSequenceClassification, transformers.GPT2LMHeadModel)
_ = (transformers.LlamaForCausalLM, transformers.get_linear_schedule_with_warmup)

HERE = Path(__file__).resolve().parent


def _run(script: str, *args: str, out: Path) -> list[RankOutput]:
    outputs = run_script(HERE / script, *args, out=out)
    for rank, output in enumerate(outputs):
        assert output.exit_code == 0, f"rank {rank}:\n{output.stderr[-3000:]}"
    return outputs


def _numbers(pattern: str, text: str) -> list[float]:
    values = [float(v) for v in re.findall(pattern, text)]
    assert values and all(math.isfinite(v) for v in values), text[-2000:]
    return values


def test_resnet_example_trains_each_plan_and_resumes_exactly(tmp_path: Path) -> None:
    small = ("--batch_size", "4", "--num_samples", "16")
    fp16 = _run("resnet_train.py", "-p", "torch_ddp_fp16", "--epochs", "1", "-i", "0",
                "--num_samples", "8", "--batch_size", "4", out=tmp_path / "fp16")  # fmt: skip
    assert "Accuracy of the model" in fp16[0].stdout
    _numbers(r"epoch 0 loss ([\d.]+)", fp16[0].stdout)
    checkpoint = str(tmp_path / "checkpoint")
    whole = _run("resnet_train.py", "-p", "gemini", "--epochs", "3", "-i", "2", "-c", checkpoint,
                 *small, out=tmp_path / "whole")  # fmt: skip
    assert (Path(checkpoint) / "model_2.pth").is_file()
    resumed = _run("resnet_train.py", "-p", "gemini", "--epochs", "3", "-i", "0", "-r", "2",
                   "-c", checkpoint, *small, out=tmp_path / "resumed")  # fmt: skip
    for rank in range(2):
        assert "epoch 1 loss" not in resumed[rank].stdout  # it started at epoch 2
        assert _numbers(r"epoch 2 loss ([\d.]+)", resumed[rank].stdout) == _numbers(
            r"epoch 2 loss ([\d.]+)", whole[rank].stdout
        )


def test_glue_bert_example_runs_each_plugin_and_zero_tracks_ddp(tmp_path: Path) -> None:
    final: dict[str, float] = {}
    for plugin in ("torch_ddp", "torch_ddp_fp16", "gemini", "low_level_zero"):
        outputs = _run("glue_bert_finetune.py", "-p", plugin, "--batch_size", "4",
                       "--num_samples", "32", out=tmp_path / plugin)  # fmt: skip
        losses = _numbers(r"step \d+ loss ([\d.]+)", outputs[0].stdout)
        assert len(losses) == 4
        final[plugin] = _numbers(r"'loss': ([\d.]+)", outputs[0].stdout)[0]
    # fp16 storage and communication (ZeRO) or fp16 autocast, against fp32: 4 steps of a
    # 2.4e-5 learning rate move the evaluation loss by far less than fp16's rounding allows.
    for plugin in ("torch_ddp_fp16", "gemini", "low_level_zero"):
        assert final[plugin] == pytest.approx(final["torch_ddp"], abs=1e-4), final


@pytest.mark.parametrize("plan", ["CAI_ZeRO1", "CAI_ZeRO2", "CAI_Gemini"])
def test_gpt_gemini_demo_runs_each_plan(plan: str, tmp_path: Path) -> None:
    outputs = _run("gpt_gemini_train_demo.py", "--distplan", plan, "--train_step", "4",
                   "--batch_size", "2", out=tmp_path)  # fmt: skip
    log = outputs[0].stderr  # the logger writes to stderr, on rank 0 (ranks=[0])
    assert len(_numbers(r"Loss:([\d.]+)", log)) == 4
    assert "Median TFLOPS" in log
    assert "Loss:" not in outputs[1].stderr


def test_llama_benchmark_runs_its_gemini_plans(tmp_path: Path) -> None:
    for plan, extra in (
        ("gemini", ()),
        ("gemini_auto", ()),
        # ColossalAI ignores the payload offload while chunks stay gathered (with a warning,
        # which the script silences): it runs.
        ("gemini", ("--shard_param_frac", "0.5", "--offload_param_frac", "0.5")),
    ):
        outputs = _run("llama_benchmark.py", "-p", plan, "-l", "32", "-s", "3", "-i", "1",
                       *extra, out=tmp_path / f"{plan}{len(extra)}")  # fmt: skip
        assert len(_numbers(r"Step \d loss: ([\d.]+)", outputs[1].stdout)) == 3
        assert "Max device memory usage" in outputs[0].stdout
    refused = run_script(HERE / "llama_benchmark.py", "--tp", "2", "-l", "32", out=tmp_path / "tp")
    assert all(output.exit_code == 1 for output in refused)
    assert "leave tp_size=1" in refused[0].stderr
