"""Ported from Lightning-AI/pytorch-lightning (1.9),
tests/tests_pytorch/strategies/test_ddp_fully_sharded_with_full_state_dict.py (fairscale's
`DDPFullyShardedStrategy`, whose arguments `FullyShardedStrategy` takes) and
tests/tests_pytorch/strategies/test_ddp_fully_sharded_native.py (`DDPFullyShardedNativeStrategy`),
against `FullyShardedStrategy`.

The originals run on one or two GPUs with precision 16; these run on 2 CPU ranks over gloo with
fp16 chunk payloads and fp32 compute (`ShardwisePrecision("16-mixed")`). All multi-rank
sub-cases share one group of forked ranks. "Wrapped in FSDP" becomes "every parameter is
managed by the engine's chunks and released after use" (a chunk is the engine's wrapped unit);
manual wrapping in `configure_sharded_model` becomes building the layers in `configure_model`
(the hook's name since Lightning 2.1), where the strategy slices them as they are built.

Kept: `_run_multiple_stages` (fit, `save_checkpoint(weights_only=True)`, the saved weights equal
to `lightning_module_state_dict()` through `load_from_checkpoint`, then test and predict with
the module and with `ckpt_path`), for the manually and the auto-wrapped model, the manual
model's `on_load_checkpoint` rebuilding its layers ("when loading full state dict, we first
need to create a new unwrapped model": the strategy shards the rebuilt layers), the per-batch
checks in every loop, `sync_batchnorm=True`, the precision plugin chosen from the Trainer's
precision and its dtypes, the `cpu_offload` spellings, and the refusal of an optimizer over
parameters the strategy does not manage. Added: test and predict from the checkpoint equal
test and predict of the trained module.

Deliberate differences, asserted as shardwise documents them (see the comments at each test):
CPU is supported (the originals refuse it); gradient clipping by norm is honoured (the fairscale
strategy refused it) and by value refused; the same module instance is tested after fit (the
fairscale strategy refused to wrap it again; the engine keeps it); no `mixed_precision=` /
`CPUOffload` objects (the fairscale-era arguments `compute_dtype`, `fp32_reduce_scatter` and a
bool `cpu_offload` instead).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_cases import trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffload
from torch.utils.data import DataLoader, TensorDataset

from shardwise import ZeroModel
from shardwise.cli import main as shardwise_cli
from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy, ShardwisePrecision

# ---- construction, on one process ---------------------------------------------------------------


def test_cpu_is_supported() -> None:
    # Original: test_invalid_on_cpu (both files), a MisconfigurationException "... but GPU is
    # not available". Deliberate difference: the engine runs on CPU over gloo (the fits below).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = pl.Trainer(fast_dev_run=True, strategy="shardwise_fsdp", accelerator="cpu")
    assert isinstance(run.strategy, FullyShardedStrategy)
    assert run.strategy.root_device == torch.device("cpu")


def test_fsdp_with_sharded_amp() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = pl.Trainer(
            fast_dev_run=True, strategy="shardwise_fsdp", accelerator="cpu", precision=16
        )
    assert isinstance(run.strategy, FullyShardedStrategy)
    assert isinstance(run.strategy.precision_plugin, ShardwisePrecision)
    # Deliberate difference: on CPU Lightning's connector turns 16 / "16-mixed" into
    # "bf16-mixed" (with a warning) before any strategy sees it; ShardwisePrecision("16-mixed")
    # passed as the plugin keeps fp16 payloads (the fits below use it).
    assert run.strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("precision", "expected"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
)
def test_precision_plugin_config(precision: str, expected: torch.dtype) -> None:
    # The original's device="cuda": every dtype is the 16-bit one. On CPU the math is fp32
    # (16-bit matmuls are ~50x slower there), payloads and reduction stay 16-bit.
    plugin = ShardwisePrecision(precision)
    config = plugin.mixed_precision(torch.device("cuda")).chunk_dtypes()
    assert (config.payload, config.compute, config.reduce) == (expected, expected, expected)
    config = plugin.mixed_precision(torch.device("cpu")).chunk_dtypes()
    assert (config.payload, config.compute, config.reduce) == (expected, torch.float32, expected)


def test_fsdp_custom_mixed_precision() -> None:
    # Original: DDPFullyShardedNativeStrategy(mixed_precision=MixedPrecision()). Deliberate
    # difference: FullyShardedStrategy takes the fairscale strategy's compute_dtype and
    # fp32_reduce_scatter, which reach the engine's mixed-precision config.
    strategy = FullyShardedStrategy(
        compute_dtype=torch.bfloat16,
        fp32_reduce_scatter=True,
        precision_plugin=ShardwisePrecision("bf16-mixed"),
    )
    config = strategy.engine_config(torch.device("cpu")).precision.chunk_dtypes()
    assert (config.payload, config.compute, config.reduce) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )


def test_chunk_size_is_searched_as_for_gemini_unless_set() -> None:
    # Deliberate difference: the original wrapped units of min_num_params=100M parameters by
    # default, which here made one chunk of most of a GPT-2 124M. Unset, the engine searches
    # the size, as it does for GeminiStrategy; set, it is the chunk size.
    cpu = torch.device("cpu")
    searched = FullyShardedStrategy().engine_config(cpu).chunking
    assert searched.size_numel is None
    assert searched == GeminiStrategy(placement_policy="cuda").engine_config(cpu).chunking
    assert FullyShardedStrategy(min_num_params=700).engine_config(cpu).chunking.size_numel == 700


def test_fully_sharded_strategy_cpu_offload() -> None:
    strategy = FullyShardedStrategy(cpu_offload=True)
    assert strategy.cpu_offload is True
    assert strategy.engine_config(torch.device("cpu")).placement.policy.name == "cpu"
    assert FullyShardedStrategy().engine_config(torch.device("cpu")).placement.policy.name == "cuda"
    # Deliberate difference: a bool, as for the fairscale strategy; torch's CPUOffload dataclass
    # (native FSDP's second spelling) is refused rather than read.
    with pytest.raises(TypeError, match="cpu_offload must be a bool"):
        FullyShardedStrategy(cpu_offload=CPUOffload(offload_params=True))  # type: ignore[arg-type]


# ---- models ------------------------------------------------------------------------------------


class BoringModel(pl.LightningModule):
    """Lightning's demo BoringModel reduced to what these tests use: 64 random 32-feature
    samples, the sum of the outputs as the loss in every loop."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: nn.Module | None = None
        self.checked: dict[str, int] = {}

    def forward(self, x: Tensor) -> Tensor:
        assert self.layer is not None
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).sum(), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self(batch[0]).sum(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])

    def _loader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 32, generator=generator)), batch_size=2)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader

    def _layers(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    # The originals' _assert_layer_fsdp_instance, after every batch of every loop.
    def on_train_batch_end(self, *_: Any, **__: Any) -> None:
        self._assert_sharded("train")

    def on_validation_batch_end(self, *_: Any, **__: Any) -> None:
        self._assert_sharded("validation")

    def on_test_batch_end(self, *_: Any, **__: Any) -> None:
        self._assert_sharded("test")

    def on_predict_batch_end(self, *_: Any, **__: Any) -> None:
        self._assert_sharded("predict")

    def _assert_sharded(self, loop: str) -> None:
        strategy = self.trainer.strategy
        assert isinstance(strategy, FullyShardedStrategy)
        assert isinstance(self.trainer.model, ZeroModel)  # the root is wrapped
        engine = strategy.zero_model
        assert engine is not None and engine.module is self
        assert self.layer is not None
        for index in (0, 2):
            for param in self.layer[index].parameters():
                assert engine.chunk_manager.manages(param)
                # reshard_after_forward: only this rank's slice is kept between uses (the
                # parameter keeps its shape, as FSDP's do, and holds no element).
                assert param.data.numel() == 0
        assert isinstance(strategy.precision_plugin, ShardwisePrecision)
        assert strategy.precision_plugin.precision == "16-mixed"
        dtypes = engine.chunk_manager.chunks[0].dtypes
        assert dtypes.payload == torch.float16 and dtypes.reduce == torch.float16
        self.checked[loop] = self.checked.get(loop, 0) + 1


class TestFSDPModelManualWrapped(BoringModel):
    """The original builds in setup() and wraps in configure_sharded_model; here
    configure_model builds, and the strategy slices the layers as they are built. As in the
    original, on_load_checkpoint builds new, unwrapped layers for the checkpoint to fill: the
    strategy shards them before the weights load."""

    __test__ = False

    def configure_model(self) -> None:
        if self.layer is None:
            self.layer = self._layers()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The original's comment: "when loading full state dict, we first need to create a
        # new unwrapped model".
        self.layer = self._layers()

    def configure_optimizers(self) -> Any:
        assert self.layer is not None
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class TestFSDPModelAutoWrapped(BoringModel):
    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.layer = self._layers()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)


class ForeignParametersModel(TestFSDPModelManualWrapped):
    # Native's NoFlatParametersModel: an optimizer over a layer the module does not own.
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(nn.Linear(4, 5).parameters(), lr=1e-2)


# ---- per-rank runs -----------------------------------------------------------------------------


def _strategy(**kwargs: Any) -> FullyShardedStrategy:
    # The original's min_num_params=2 (fairscale: wrap every layer with 2+ parameters) gives
    # many small wrapped units; 700 elements per chunk gives three chunks of this model here.
    return FullyShardedStrategy(
        min_num_params=700, precision_plugin=ShardwisePrecision("16-mixed"), **kwargs
    )


def _loops(**kwargs: Any) -> dict[str, Any]:
    return {
        "max_epochs": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 2,
        **kwargs,
    }


def _run_multiple_stages(
    directory: Path, model: BoringModel, state_dict_type: str, **kwargs: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ck = ModelCheckpoint(dirpath=directory, save_last=True)
    strategy = _strategy(state_dict_type=state_dict_type)
    run = trainer(strategy, **_loops(enable_checkpointing=True, callbacks=[ck], **kwargs))
    run.fit(model)
    model_path = Path(ck.last_model_path)
    run.save_checkpoint(model_path, weights_only=True)

    # _assert_save_equality: the saved weights are the engine's whole fp32 weights
    # (lightning_module_state_dict gives them with "full"; with "sharded" this rank's shards,
    # as FSDPStrategy's, and the engine's state_dict the whole state).
    if state_dict_type == "full":
        whole = run.strategy.lightning_module_state_dict()
    else:
        whole = strategy.zero_model.state_dict()
    if run.is_global_zero:
        readable = model_path
        if state_dict_type == "sharded":
            # Deliberate difference: a sharded checkpoint is a directory, which
            # load_from_checkpoint cannot read; `shardwise consolidate` makes it one file.
            readable = directory / "consolidated.ckpt"
            assert shardwise_cli(["consolidate", str(model_path), str(readable)]) == 0
        saved = type(model).load_from_checkpoint(readable, map_location="cpu")
        assert whole.keys() == saved.state_dict().keys()
        for key, value in saved.state_dict().items():
            assert torch.equal(whole[key].float().cpu(), value), key
        out["compared"] = len(whole)
    dist.barrier()

    # The trained, sharded module first: not wrapped again. From the checkpoint, the
    # auto-wrapped case takes a new module per call as in the original (each is wrapped anew,
    # and the strategy then holds that one), the manual case the trained one.
    fresh = type(model) if isinstance(model, TestFSDPModelAutoWrapped) else None
    out["test"] = run.test(model, verbose=False)
    predicted = run.predict(model)
    trained_layers = [id(p) for p in model.parameters()]
    out["test_ckpt"] = run.test(fresh() if fresh else model, ckpt_path=model_path, verbose=False)
    # The manual model's on_load_checkpoint built new layers, which ran sharded.
    out["layers_rebuilt"] = trained_layers != [id(p) for p in model.parameters()]
    from_ckpt = run.predict(fresh() if fresh else model, ckpt_path=model_path)
    assert predicted is not None and from_ckpt is not None
    out["predict"] = torch.cat([p for p in predicted if isinstance(p, Tensor)])
    out["predict_ckpt"] = torch.cat([p for p in from_ckpt if isinstance(p, Tensor)])
    out["checked"] = dict(model.checked)
    out["model_path"] = model_path
    return out


def _refused(make: Any, **kwargs: Any) -> str:
    try:
        trainer(_strategy(), **_loops(**kwargs)).fit(make())
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _all_cases(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # test_fully_sharded_native_strategy_sync_batchnorm: the manual model, sync_batchnorm.
        # As in the original the model has no BatchNorm, so this checks that the flag's
        # layer-sync step composes with the strategy; torch's SyncBatchNorm itself refuses
        # CPU tensors (under ddp too), so a BatchNorm model would need CUDA.
        torch.manual_seed(0)
        out["manual"] = _run_multiple_stages(
            directory / "manual", TestFSDPModelManualWrapped(), "full", sync_batchnorm=True
        )
        torch.manual_seed(0)
        out["auto"] = _run_multiple_stages(
            directory / "auto", TestFSDPModelAutoWrapped(), "sharded"
        )

        # test_fsdp_gradient_clipping_raises: the fairscale strategy refused norm clipping.
        # Deliberate difference: the engine clips the global norm across shards; by value is
        # what cannot be honoured.
        strategy = _strategy()
        trainer(strategy, **_loops(gradient_clip_val=1, gradient_clip_algorithm="norm")).fit(
            TestFSDPModelManualWrapped()
        )
        engine_optimizer = strategy.zero_optimizer()
        assert engine_optimizer is not None
        out["max_norm"] = engine_optimizer.max_norm
        out["clip_by_value"] = _refused(
            TestFSDPModelManualWrapped, gradient_clip_val=1, gradient_clip_algorithm="value"
        )

        # test_fsdp_rewrap_limitation: the fairscale strategy refused trainer.test(model) after
        # fit ("Using the same instance of model ... not supported"). Deliberate difference:
        # the engine keeps the sharded module and the same Trainer tests it.
        strategy = _strategy()
        model = TestFSDPModelAutoWrapped()
        run = trainer(strategy, max_steps=1, limit_val_batches=0, limit_test_batches=1)
        run.fit(model)
        engine = strategy.zero_model
        out["rewrap_test"] = run.test(model, verbose=False)
        out["rewrap_same_engine"] = strategy.zero_model is engine
        out["rewrap_checked"] = dict(model.checked)

        # test_invalid_parameters_in_optimizer (native), NoFlatParametersModel.
        out["foreign"] = _refused(ForeignParametersModel)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("ported_fully_sharded")
    return run_ranks(_all_cases, 2, directory, timeout_s=240)


@pytest.mark.parametrize("case", ["manual", "auto"])
def test_fully_sharded_strategy_checkpoint_multi_gpus(
    ranks: list[dict[str, Any]], case: str
) -> None:
    assert ranks[0][case]["compared"] == 4  # two Linear layers, weight and bias
    for result in ranks:
        stages = result[case]
        # Every loop ran its batches and checked the sharding after each one (predict twice,
        # test twice: with the module and from the checkpoint).
        expected = {"train": 2, "validation": 2, "test": 2, "predict": 2}
        if case == "manual":  # the same module runs the checkpoint stages too
            expected.update(test=4, predict=4)
        assert stages["checked"] == expected, stages["checked"]
        # The manual model's on_load_checkpoint rebuilt its layers (checked sharded after every
        # batch above), and the checkpoint's weights reached them.
        assert stages["layers_rebuilt"] is (case == "manual")
        assert stages["test_ckpt"] == stages["test"]
        assert stages["predict"].shape == (4, 2)  # 2 batches of 2 on this rank
        assert torch.equal(stages["predict_ckpt"], stages["predict"])
        assert stages["model_path"].name == "last.ckpt"


def test_fsdp_gradient_clipping(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["max_norm"] == 1.0
        assert result["clip_by_value"].startswith("ValueError: gradient_clip_algorithm='value'")


def test_fsdp_rewrap_limitation_lifted(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["rewrap_same_engine"] is True
        assert result["rewrap_checked"] == {"train": 1, "test": 1}
        assert len(result["rewrap_test"]) == 1 and "test_loss" in result["rewrap_test"][0]


def test_invalid_parameters_in_optimizer(ranks: list[dict[str, Any]]) -> None:
    # Native: "The optimizer does not seem to reference any FSDP parameters". The original's
    # EmptyParametersModel (an optimizer built before wrapping) trains here, as the fits above
    # (configure_optimizers runs after the strategy wrapped the module).
    for result in ranks:
        assert result["foreign"].startswith("ValueError: optimizer holds 2 parameter(s)")
        assert "the model does not own" in result["foreign"]
