"""The `shardwise plan` command line's traps: sizes without units, a plan where nothing fits,
activations left out, the host's memory credited to every rank, a `--model` that does not
build, and activations estimated from the model other than the estimator would."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.cli import main, size_in_bytes
from shardwise.planner import estimate_activation_bytes

# Fits at every stage on these machines: a small model, plenty of memory.
SMALL = ["plan", "--params", "1e6", "--world-size", "2"]
ROOMY = ["--device-memory", "1TB", "--host-memory", "1TB"]
# 7.5e9 fp32 parameters with Adam: 120 GB of state, which 2 ranks of 1 GB cannot hold.
TIGHT = ["plan", "--params", "7.5e9", "--world-size", "2", "--device-memory", "1GB",
         "--host-memory", "1GB"]  # fmt: skip
MODULE = "_shardwise_planner_cli_models"


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `main(argv)`, expect argparse's usage error (exit status 2), and return its line."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# Trap 1: sizes carry a unit.


@pytest.mark.parametrize(
    "option", ["--device-memory", "--host-memory", "--disk-memory", "--activation-memory"]
)
def test_a_size_without_a_unit_is_refused_with_the_fix(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*SMALL, *ROOMY, option, "80"]
    line = _usage_error(argv, capsys)
    assert line == (
        f"shardwise plan: error: argument {option}: 80 has no unit: write 80GB or 80GiB "
        f"(or 80B for bytes)"
    )


def test_sizes_with_units_still_read_and_zero_means_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert size_in_bytes("80GB") == 80 * 10**9
    assert size_in_bytes("80 GiB") == 80 * 2**30
    assert size_in_bytes("512MiB") == 512 * 2**20
    assert size_in_bytes("1.5TB") == 1_500_000_000_000
    assert size_in_bytes("24gib") == 24 * 2**30
    assert size_in_bytes("1.5e9B") == 1_500_000_000
    assert size_in_bytes("4KB") == 4000 and size_in_bytes("4KiB") == 4096
    argv = [*SMALL, *ROOMY, "--disk-memory", "0", "--activation-memory", "0", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["activation_bytes"] == 0 and result["activations_counted"] is True
    assert all(option["placement"] != "disk" for option in result["options"])
    # A bare 0 device or host memory means nothing: it needs a unit like any other size.
    assert "0 has no unit" in _usage_error([*SMALL, "--device-memory", "0", "--host-memory",
                                            "1TB"], capsys)  # fmt: skip
    assert "not a size: '80XB'" in _usage_error([*SMALL, "--device-memory", "80XB"], capsys)
    assert "too large" in _usage_error([*SMALL, "--device-memory", "1e999GB"], capsys)


def test_counts_refuse_fractions_and_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    huge = ["plan", "--params", "1e999", "--world-size", "2", *ROOMY]
    assert "not a count: '1e999'" in _usage_error(huge, capsys)
    assert "not a count: '2.5'" in _usage_error([*SMALL, *ROOMY, "--chunk-size", "2.5"], capsys)
    assert "not a positive int: '0'" in _usage_error(
        ["plan", "--params", "1e6", "--world-size", "0", *ROOMY], capsys
    )


# Trap 2: nothing fits -> exit status 1, the output printed all the same.


def test_nothing_fits_prints_the_plan_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TIGHT) == 1
    captured = capsys.readouterr()
    assert "| DDP |" in captured.out and "recommended: none fits" in captured.out
    assert "# nothing fits: add ranks, device memory or host memory" in captured.out
    assert "no configuration fits (exit status 1)" in captured.err
    assert main([*TIGHT, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"] is None and result["options"]
    # And a plan that fits still exits 0.
    assert main([*SMALL, *ROOMY]) == 0
    assert "recommended: DDP" in capsys.readouterr().out


def test_help_documents_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 when a configuration fits; 1 when none does" in text
    assert "A bare number is refused" in text
    assert "Without either, activations are not counted" in text
    assert "--batch 8 --seq-len 1024" in text


def test_the_exit_status_reaches_the_shell() -> None:
    command = [sys.executable, "-m", "shardwise.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*command, *TIGHT, "--json"], capture_output=True, text=True, env=env)
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["recommended"] is None
    run = subprocess.run(
        [*command, "plan", "--world-size", "2", "--model", "no_such_module_xyz:build"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert "--model 'no_such_module_xyz:build'" in run.stderr.splitlines()[-1]


# Trap 3: activations not counted are said to be not counted.


def test_missing_activations_are_reported_as_a_lower_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SMALL, *ROOMY]) == 0
    lines = capsys.readouterr().out.splitlines()
    (note,) = [line for line in lines if line.startswith("activations not counted")]
    assert "lower bound" in note and "--activation-memory" in note
    assert main([*SMALL, *ROOMY, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["activations_counted"] is False and result["activation_bytes"] == 0
    assert any("lower bound" in line for line in result["notes"])
    # Given, they are counted and nothing is said.
    assert main([*SMALL, *ROOMY, "--activation-memory", "2GB"]) == 0
    assert "activations not counted" not in capsys.readouterr().out
    assert main([*SMALL, *ROOMY, "--activation-memory", "2GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["activations_counted"] is True and result["activation_bytes"] == 2 * 10**9
    assert result["smallest_budget_bytes"]["auto"] > 2 * 10**9


# Trap 4: detected host memory is divided among the ranks on the host.


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, num_devices: int, capacity: int) -> None:
    properties = SimpleNamespace(name="Fake GPU", total_memory=capacity)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_devices)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)


def _detected(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, int]:
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    return {key: result[key] for key in ("device_memory_bytes", "host_memory_bytes",
                                         "ranks_per_node")}  # fmt: skip


def test_detected_host_memory_is_shared_by_one_rank_per_cuda_device(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_cuda(monkeypatch, num_devices=8, capacity=80 * 10**9)
    host = _host_bytes()
    plan_64 = ["plan", "--params", "1e6", "--world-size", "64"]
    assert _detected(plan_64, capsys) == {
        "device_memory_bytes": 80 * 10**9, "host_memory_bytes": host // 8, "ranks_per_node": 8,
    }  # fmt: skip
    # Fewer ranks than devices: the ranks there are share the host.
    assert _detected(SMALL, capsys)["host_memory_bytes"] == host // 2
    assert _detected([*plan_64, "--ranks-per-node", "4"], capsys)["host_memory_bytes"] == host // 4
    assert main(plan_64) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("planning with this machine's Fake GPU: device: 80.0 GB per rank")
    assert "/ 8 ranks per node (one per CUDA device here (8), at most --world-size) = " in line
    assert f"{host // 8 / 1e9:.1f} GB per rank" in line
    # Only the device's capacity detected: nothing divided, and --ranks-per-node refused.
    assert _detected([*plan_64, "--host-memory", "2TB"], capsys) == {
        "device_memory_bytes": 80 * 10**9, "host_memory_bytes": 2 * 10**12,
        "ranks_per_node": None,
    }  # fmt: skip
    line = _usage_error([*plan_64, "--host-memory", "2TB", "--ranks-per-node", "4"], capsys)
    assert "--ranks-per-node divides this host's detected memory" in line


def test_detected_memory_without_cuda_is_shared_by_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    host = _host_bytes()
    plan_4 = ["plan", "--params", "1e6", "--world-size", "4"]
    assert _detected(plan_4, capsys) == {
        "device_memory_bytes": host // 4, "host_memory_bytes": host // 4, "ranks_per_node": 4,
    }  # fmt: skip
    assert main(plan_4) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("planning with this host's memory (no CUDA device")
    assert "/ 4 ranks per node (--world-size: without CUDA every rank runs on this host)" in line
    assert f"= {host // 4 / 1e9:.1f} GB per rank" in line
    # A given size is used as given; the detected one is still divided.
    assert _detected([*plan_4, "--device-memory", "1TB", "--ranks-per-node", "2"], capsys) == {
        "device_memory_bytes": 10**12, "host_memory_bytes": host // 2, "ranks_per_node": 2,
    }  # fmt: skip
    line = _usage_error([*plan_4, *ROOMY, "--ranks-per-node", "2"], capsys)
    assert "--device-memory and --host-memory are both given" in line
    line = _usage_error([*plan_4, "--ranks-per-node", "8"], capsys)
    assert line.endswith("--ranks-per-node (8) exceeds --world-size (4)")


# Trap 5: a --model that does not build is a usage error naming what was given.


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories, good and bad, importable as MODULE; also MODULE_broken, which
    raises on import."""
    (tmp_path / f"{MODULE}.py").write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                return torch.nn.Linear(1000, 1000)

            def raises():
                raise RuntimeError("weights not found\\nsecond line")

            def not_a_module():
                return {"weight": 1}

            def frozen():
                return torch.nn.Linear(4, 4).requires_grad_(False)

            def llama():
                from transformers import LlamaConfig, LlamaForCausalLM

                config = LlamaConfig(hidden_size=64, intermediate_size=172,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256)
                return LlamaForCausalLM(config)

            def token_mlp():  # reads token ids positionally; takes no labels, no checkpointing
                return torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 8))

            not_callable = 3
            """
        )
    )
    (tmp_path / f"{MODULE}_broken.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    for name in (MODULE, f"{MODULE}_broken"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("build_model", "--model must be package.module:factory"),
        (":build", "--model must be package.module:factory"),
        ("no_such_module_xyz:build", "module 'no_such_module_xyz' does not import "
         "(ModuleNotFoundError: No module named 'no_such_module_xyz')"),
        (f"{MODULE}_broken:build", f"module '{MODULE}_broken' does not import "
         "(ModuleNotFoundError: No module named 'no_such_dependency_xyz')"),
        (f"{MODULE}:missing", f"module '{MODULE}' has no attribute 'missing'"),
        (f"{MODULE}:not_callable", f"module '{MODULE}' has a non-callable attribute"),
        (f"{MODULE}:raises", "raises() raised RuntimeError: weights not found; expected it to "
         "build the model with no arguments on the meta device"),
        (f"{MODULE}:not_a_module", "not_a_module() returned dict, expected a torch.nn.Module"),
        (f"{MODULE}:frozen", "the module has no trainable parameters"),
    ],
)  # fmt: skip
def test_a_model_that_does_not_build_is_a_one_line_usage_error(
    models: str, target: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _usage_error(["plan", "--world-size", "2", *ROOMY, "--model", target], capsys)
    assert line.startswith("shardwise plan: error: --model")
    assert repr(target) in line and expected in line
    assert "second line" not in line


def test_a_model_that_builds_is_planned(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", f"{models}:build", "--world-size", "2", *ROOMY,
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["num_params"] == 1000 * 1000 + 1000


# Trap 6: activations estimated from --model are the estimator's own figure, and say so.

ESTIMATE = ["--batch", "2", "--seq-len", "16"]


def _planned(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def _meta_llama(models: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    with torch.device("meta"):
        model: torch.nn.Module = importlib.import_module(models).llama()
    return model.to(dtype).train()


def _llama_inputs(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    # A 4-D mask: Hugging Face's own mask preparation reads values, which meta has not.
    mask = torch.zeros(2, 1, 16, 16, dtype=dtype, device="meta")
    return {"input_ids": ids, "labels": ids, "attention_mask": mask}


def test_activations_estimated_from_a_llama_are_the_estimators_figure(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = ["plan", "--model", f"{models}:llama", "--world-size", "2", *ROOMY]
    result = _planned([*llama, *ESTIMATE], capsys)
    direct = estimate_activation_bytes(_meta_llama(models), **_llama_inputs())
    assert direct.saved_bytes > 0 and direct.recompute_bytes == 0
    assert result["activations_counted"] is True
    assert result["activation_source"] == "estimated"
    assert result["activation_bytes"] == direct.total_bytes
    assert result["activation_estimate"] == {
        "batch_size": 2, "seq_len": 16, "checkpointing": False, "dtype": "fp32",
        "saved_bytes": direct.saved_bytes, "output_bytes": direct.output_bytes,
        "recompute_bytes": 0,
    }  # fmt: skip
    # The plan counts it as it counts the same bytes given.
    given = _planned([*llama, "--activation-memory", f"{direct.total_bytes}B"], capsys)
    assert given["activation_source"] == "given" and given["activation_estimate"] is None
    for key in ("options", "smallest_budget_bytes", "activation_bytes"):
        assert result[key] == given[key]
    budget, none = result["smallest_budget_bytes"], _planned(llama, capsys)["smallest_budget_bytes"]
    assert isinstance(budget, dict) and isinstance(none, dict)
    assert budget["auto"] == none["auto"] + direct.total_bytes
    # The forward computes in the compute dtype: bf16 activations, a bf16 mask.
    bf16 = _planned([*llama, *ESTIMATE, "--dtype", "bf16"], capsys)
    direct_bf16 = estimate_activation_bytes(
        _meta_llama(models, torch.bfloat16), **_llama_inputs(torch.bfloat16)
    )
    assert bf16["activation_bytes"] == direct_bf16.total_bytes < direct.total_bytes
    # The text says where the figure came from.
    assert main([*llama, *ESTIMATE]) == 0
    out = capsys.readouterr().out
    assert "activations estimated from the model at batch 2 x 16 (checkpointing off)" in out
    assert main([*llama, "--activation-memory", "2GB"]) == 0
    assert "activations as given (--activation-memory): 2.0 GB per rank" in (
        capsys.readouterr().out
    )


def test_checkpointing_estimates_less_than_without(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = ["plan", "--model", f"{models}:llama", "--world-size", "2", *ROOMY, *ESTIMATE]
    plain = _planned(llama, capsys)
    checkpointed = _planned([*llama, "--checkpointing"], capsys)
    assert checkpointed["activation_bytes"] < plain["activation_bytes"]  # type: ignore[operator]
    model = _meta_llama(models)
    with warnings.catch_warnings():  # renamed activation_checkpointing_enable in 5.2x
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    direct = estimate_activation_bytes(model, **_llama_inputs())
    assert direct.recompute_bytes > 0
    assert checkpointed["activation_bytes"] == direct.total_bytes
    estimate = checkpointed["activation_estimate"]
    assert isinstance(estimate, dict) and estimate["checkpointing"] is True
    assert estimate["recompute_bytes"] == direct.recompute_bytes
    assert main([*llama, "--checkpointing"]) == 0
    assert "at batch 2 x 16 (checkpointing on)" in capsys.readouterr().out


def test_a_model_without_labels_gets_the_token_ids_alone(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", f"{models}:token_mlp", "--world-size", "2", *ROOMY, *ESTIMATE]
    result = _planned(argv, capsys)
    with torch.device("meta"):
        model = importlib.import_module(models).token_mlp()
    direct = estimate_activation_bytes(model, torch.zeros(2, 16, dtype=torch.long, device="meta"))
    # The Linear keeps the embeddings (2 x 16 x 32 fp32); the output is 2 x 16 x 8 fp32.
    assert direct.saved_bytes == 2 * 16 * 32 * 4 and direct.output_bytes == 2 * 16 * 8 * 4
    assert result["activation_bytes"] == direct.total_bytes


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "{models}:llama", *ESTIMATE, "--activation-memory", "2GB"],
         "--activation-memory gives the activations and --batch/--seq-len estimate them: pick "
         "one"),
        (["--model", "{models}:llama", "--seq-len", "16", "--activation-memory", "2GB"],
         "pick one"),
        (["--model", "{models}:llama", "--batch", "2"], "--batch without --seq-len"),
        (["--model", "{models}:llama", "--seq-len", "16"], "--seq-len without --batch"),
        (["--params", "1e6", *ESTIMATE], "--batch/--seq-len estimate the activations from the "
         "model: give it with --model (package.module:factory"),
        (["--model", "{models}:llama", "--checkpointing"], "--checkpointing applies to the "
         "estimate: give --model with --batch and --seq-len"),
        (["--model", "{models}:token_mlp", *ESTIMATE, "--checkpointing"], "builds a Sequential, "
         "which has no gradient_checkpointing_enable()"),
        (["--model", "{models}:llama", "--batch", "0", "--seq-len", "16"],
         "argument --batch: not a positive int: '0'"),
        (["--model", "{models}:build", *ESTIMATE], "estimating the activations at "
         "batch 2 x 16, its forward raised"),
    ],
)  # fmt: skip
def test_activation_options_that_cannot_be_honoured_are_refused(
    models: str, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [arg.format(models=models) for arg in argv]
    line = _usage_error(["plan", "--world-size", "2", *ROOMY, *argv], capsys)
    assert line.startswith("shardwise plan: error: ") and expected in line
