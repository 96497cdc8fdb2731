"""What the planner prints: rows by stage with the recommended one marked, device figures that
count the activations given (and say what they count), the minimum chunk size named in the
project's terms, and the command line's help without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.cli import main
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.planner import ModelSpec, plan

SPEC = ModelSpec(num_params=7 * 10**9, largest_tensor_numel=10**7)
MEMORY = {"device_memory_bytes": 80 * 10**9, "host_memory_bytes": 500 * 10**9}
CLI = ["plan", "--params", "7e9", "--world-size", "8", "--device-memory", "80GB",
       "--host-memory", "500GB"]  # fmt: skip


def _rows(table: str) -> list[list[str]]:
    """The table's body: its cells, row by row."""
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    lines = lines[1:]  # the header
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_rows_come_by_stage_and_the_recommended_one_is_marked() -> None:
    answer = plan(SPEC, world_size=8, disk_memory_bytes=10**13, **MEMORY)
    names = [row[0] for row in _rows(answer.table())]
    assert names == [
        "DDP",
        "stage 1 (cuda)",
        "stage 2 (cuda)",
        "stage 2 (cpu)",
        "stage 2 (disk)",
        "stage 3 (cuda)",
        "stage 3 (auto)",
        "stage 3 (cpu)",
        "stage 3 (disk)",
    ]
    assert [option.name for option in answer.options] == names  # and in the JSON
    # The recommendation keeps its order of preference: stage 2 before stage 1 where both fit.
    assert answer.recommended is not None and answer.recommended.name == "stage 2 (cuda)"
    marked = [row[0] for row in _rows(answer.table()) if row[-1] == "yes, recommended"]
    assert marked == ["stage 2 (cuda)"]
    assert _rows(answer.table())[1][-1] == "yes"  # stage 1 fits, not recommended


def test_the_device_column_counts_the_activations_given() -> None:
    activations = 6 * 2**30
    without = plan(SPEC, world_size=8, **MEMORY)
    given = plan(SPEC, world_size=8, activation_bytes=activations, **MEMORY)
    for option, row_without, row_given in zip(
        given.options, _rows(without.table()), _rows(given.table()), strict=True
    ):
        if option.placement == "auto":
            continue  # its device part shrinks to make room: checked below
        assert float(row_given[1]) == pytest.approx(
            float(row_without[1]) + activations / 1e9, abs=0.1
        )
        needed = option.device.total + option.working_bytes
        assert option.device_needed_bytes(activations) == needed + activations
    # "auto" fits exactly into the room: its figure is what it compares with the device memory.
    auto = next(o for o in given.options if o.placement == "auto")
    assert auto.device_needed_bytes(activations) <= MEMORY["device_memory_bytes"] * (1 + 1e-9)
    # The line under the table says what the figures count.
    (said,) = [line for line in given.table().splitlines() if line.startswith("device GB:")]
    assert "6.4 GB of activations" in said and "--activation-memory" in said, said
    (said,) = [line for line in without.table().splitlines() if line.startswith("device GB:")]
    assert "no activations" in said and "lower bound" in said, said


def test_the_json_gives_the_device_figures_with_the_activations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*CLI, "--activation-memory", "2GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["activation_bytes"] == 2 * 10**9
    for option in result["options"]:
        state = option["device_total"] + option["working_bytes"]
        assert option["device_needed_bytes"] == pytest.approx(state + 2 * 10**9)


def test_the_minimum_chunk_size_is_named_in_the_projects_terms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(CLI) == 0
    out = capsys.readouterr().out
    assert "seeds" not in out
    (line,) = [line for line in out.splitlines() if line.startswith("stage-3 chunk size:")]
    assert "the minimum chunk size (32 MiB, ColossalAI's default" in line, line


def test_help_names_the_engines_quantization_block_without_importing_torch() -> None:
    probe = (
        "import sys\n"
        "from shardwise.cli import main\n"
        "try:\n"
        "    main(['plan', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.splitlines()[-1] == "no torch", done.stdout
    help_text = " ".join(done.stdout.split())
    assert f"(default: the engine's, {DEFAULT_QUANT_BLOCK_NUMEL})" in help_text, help_text
