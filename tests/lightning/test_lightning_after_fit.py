"""What a new user meets with the defaults on a CPU host, 2 ranks: `GeminiStrategy()` and the
name "shardwise_gemini_auto" train ("auto" without CUDA keeps every chunk on the compute
device); `ModelCheckpoint`'s last.ckpt is one file (`state_dict_type="full"`, the default) that
`load_from_checkpoint` and `torch.load` read; and after fit the LightningModule's own
`state_dict()` holds the whole trained weights on every rank, so rank 0 alone can
`torch.save` it. Weights changed in the module after fit are the ones the next run uses.

The trained weights are compared with a plain torch loop in this process, on the same seed,
data and global batches: Lightning shuffles training data with a DistributedSampler (seed 0,
reseeded with the epoch), whose permutation the loop draws too, taking 8 samples a step where
the two ranks take 4 each. The ranks average two 4-sample mean gradients where the loop takes
one 8-sample mean, which rounds differently in the last bits; Adam's normalised update carries
that to at most ~1e-7 over 16 steps here: compared to 1e-6. Everything read back from the
module, the checkpoint file and rank 0's `torch.save` equals the ranks' state bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_cases import GLOBAL_BATCH, Net, dataset, fit, trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Subset

from shardwise.engine import module_at_rest
from shardwise.testing import run_ranks
from shardwise_lightning import GeminiStrategy

EPOCHS = 2
TOLERANCE = 1e-6  # see the module docstring


def _plain_loop() -> dict[str, torch.Tensor]:
    """`Net` trained as a user trains it without Lightning: one process, global batch 8, its
    own configure_optimizers (AdamW and StepLR stepped once per epoch, as Lightning does)."""
    torch.manual_seed(0)  # what pl.seed_everything(0) sets before the ranks build Net
    model = Net()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    data = dataset()
    for epoch in range(EPOCHS):
        # The epoch's order as Lightning's DistributedSampler(seed=0) draws it; each global
        # batch is 8 consecutive samples of it (4 to each rank).
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        for x, y in DataLoader(Subset(data, order.tolist()), batch_size=GLOBAL_BATCH):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _other_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return Net().state_dict()


def _defaults(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # GeminiStrategy() as a new user writes it, with a ModelCheckpoint keeping last.ckpt.
    pl.seed_everything(0, verbose=False)  # also the DistributedSampler's seed
    module = Net()
    checkpoints = ModelCheckpoint(dirpath=directory, save_last=True)
    strategy = GeminiStrategy()
    run = trainer(strategy, max_epochs=EPOCHS, enable_checkpointing=True, callbacks=[checkpoints])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module)
    assert strategy.zero_model is not None
    out["policy"] = strategy.zero_model.config.placement.policy.name
    out["last"] = checkpoints.last_model_path
    # The module's own state dict, no collective: rank 0 alone saves it.
    out["own_state"] = {k: v.clone() for k, v in module.state_dict().items()}
    if run.is_global_zero:
        torch.save(module.state_dict(), directory / "module.pt")
    dist.barrier()
    # trainer.save_checkpoint after fit still saves the engine's state, and leaves the module
    # whole.
    run.save_checkpoint(directory / "after_fit.ckpt")
    out["after_save"] = {k: v.clone() for k, v in module.state_dict().items()}

    # Weights loaded into the module after fit are the ones the next run computes with.
    module.load_state_dict(_other_weights())
    predicted = run.predict(module)
    assert predicted is not None
    out["predicted"] = torch.cat([p for p in predicted if isinstance(p, torch.Tensor)])
    out["after_predict"] = {k: v.clone() for k, v in module.state_dict().items()}

    # The registered name, on its own.
    out["registered_auto"] = fit("shardwise_gemini_auto", max_epochs=EPOCHS).state

    # A host without room for a whole copy per rank: the module stays sharded, and says so.
    module_at_rest._available_host_bytes = lambda: 1
    pl.seed_everything(0, verbose=False)
    too_big = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(GeminiStrategy(), max_epochs=1).fit(too_big)
    out["no_room_numels"] = [v.numel() for v in too_big.state_dict().values()]
    out["no_room_warned"] = any("lightning_module_state_dict" in str(w.message) for w in caught)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("lightning_defaults")
    return directory, run_ranks(_defaults, 2, directory, timeout_s=180)


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    return _plain_loop()


def _assert_close(ours: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == plain.keys()
    for key, value in plain.items():
        assert ours[key].shape == value.shape, key
        assert torch.allclose(ours[key], value, rtol=0, atol=TOLERANCE), key


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_default_gemini_strategies_train_without_cuda(
    ranks: tuple[Path, list[dict[str, Any]]], plain: dict[str, torch.Tensor]
) -> None:
    for result in ranks[1]:
        assert result["policy"] == "cuda"  # "auto" without a budget off CUDA
        _assert_close(result["own_state"], plain)
        _assert_close(result["registered_auto"], plain)
    # The run really trained: the weights moved from their initial values.
    torch.manual_seed(0)
    initial = Net().state_dict()
    assert all(not torch.allclose(initial[k], plain[k]) for k in plain)


def test_last_checkpoint_is_one_file_load_from_checkpoint_reads(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = ranks
    last = Path(results[0]["last"])
    assert last.name == "last.ckpt" and last.is_file()
    loaded = Net.load_from_checkpoint(last, map_location="cpu")  # a fresh module
    _assert_equal(dict(loaded.state_dict()), results[0]["own_state"])
    assert torch.load(last, weights_only=False)["global_step"] == EPOCHS * 8
    saved_after_fit = torch.load(directory / "after_fit.ckpt", weights_only=False)
    _assert_equal(saved_after_fit["state_dict"], results[0]["own_state"])


def test_module_holds_whole_weights_after_fit(
    ranks: tuple[Path, list[dict[str, Any]]], plain: dict[str, torch.Tensor]
) -> None:
    directory, results = ranks
    for result in results:
        _assert_close(result["own_state"], plain)  # every rank, whole, the trained values
        _assert_equal(result["after_save"], result["own_state"])
    _assert_equal(torch.load(directory / "module.pt"), results[0]["own_state"])
    _assert_equal(results[0]["own_state"], results[1]["own_state"])


def test_weights_loaded_after_fit_are_used_by_the_next_run(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    other = Net()
    other.load_state_dict(_other_weights())
    x = dataset().tensors[0]
    for rank, result in enumerate(ranks[1]):
        # Predict's DistributedSampler gives rank r the samples r, r + 2, ...
        with torch.no_grad():
            expected = other(x[rank::2])
        assert torch.equal(result["predicted"], expected), rank
        _assert_equal(result["after_predict"], _other_weights())


def test_a_module_too_big_for_the_host_stays_sharded_with_a_warning(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    results = ranks[1]
    for result in results:
        assert result["no_room_numels"] and not any(result["no_room_numels"])
    assert results[0]["no_room_warned"]  # rank 0 warns


class _FailsOnRankZero(Net):
    def on_train_end(self) -> None:
        if self.trainer.global_rank == 0:
            raise RuntimeError("rank 0 alone fails after training")


def _one_rank_fails() -> tuple[str, list[int]]:
    pl.seed_everything(0, verbose=False)
    module = _FailsOnRankZero()
    outcome = "finished"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer(GeminiStrategy(), max_epochs=1).fit(module)
        except RuntimeError as error:
            outcome = str(error)
    return outcome, [v.numel() for v in module.state_dict().values()]


def test_a_run_that_raised_on_one_rank_never_leaves_another_waiting() -> None:
    # Rank 0's run raises after training, rank 1's finishes: at teardown both agree not to
    # gather (rank 1 alone would wait in the gather for ever), and both return.
    (failed, failed_numels), (finished, finished_numels) = run_ranks(
        _one_rank_fails, 2, timeout_s=90
    )
    assert failed == "rank 0 alone fails after training"
    assert finished == "finished"
    assert not any(failed_numels) and not any(finished_numels)  # sharded on both ranks
