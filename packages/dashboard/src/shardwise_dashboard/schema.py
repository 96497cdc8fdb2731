"""The telemetry event schema, version 1, as the dashboard validates it.

shardwise's ranks send `{"events": [...]}` batches; each event is a JSON object described in
`shardwise.telemetry.events` (which this module mirrors without importing torch or shardwise). Every
field is checked strictly: types are not coerced ("1" is not an int), unknown fields are refused,
strings and lists are bounded, and an event of another schema version is refused with a message
naming the version seen. An event type this module does not list is refused too, naming the
type: so a dashboard from before "eval" events refused them, and shardwise's sender then
leaves them out for it. tests/dashboard check that SCHEMA_VERSION equals core's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, with_config
from typing_extensions import TypedDict

SCHEMA_VERSION = 1
"""The one place the dashboard states which event schema it speaks."""

MAX_EVENTS_PER_BATCH = 10_000
MAX_CHUNKS_PER_SNAPSHOT = 1_000_000
MAX_RANK = 1_000_000
MAX_WARNING_CHARS = 200

_MAX_INT = 2**63 - 1  # SQLite's INTEGER


def _utf8(value: str) -> str:
    # A lone surrogate ("\ud800") is valid in a JSON string but not in UTF-8 text.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return value


NonNegativeInt = Annotated[int, Field(ge=0, le=_MAX_INT)]
Text = Annotated[str, AfterValidator(_utf8)]
Name = Annotated[Text, Field(min_length=1, max_length=128)]
Rank = Annotated[int, Field(ge=0, lt=MAX_RANK)]
Pool = Literal["device", "host"]
# An optimizer side may also be on the disk tier (files under a directory the user names).
OptimPool = Literal["device", "host", "disk"]


class _Strict(BaseModel):
    # Python's JSON parser accepts NaN and Infinity, which JSON itself has no word for.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class _Base(_Strict):
    schema_version: int = Field(alias="schema", description=f"Must be {SCHEMA_VERSION}.")
    run_id: Name
    rank: Rank
    time: float = Field(ge=0, description="Unix seconds on the sending rank.")

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(
                f"event schema version {value} is not supported: this dashboard reads version "
                f"{SCHEMA_VERSION}; use a shardwise-dashboard release matching your shardwise"
            )
        return value


class RunStarted(_Base):
    """A rank joined a run."""

    type: Literal["run_started"]
    world_size: int = Field(ge=1, le=MAX_RANK)
    config: dict[str, Any] = Field(description="The engine configuration (any JSON object).")
    num_params: NonNegativeInt
    host: Text = Field(max_length=255)
    # Optional: ranks of a shardwise from before them never send these.
    run_name: Name | None = Field(default=None, description="the name the user gave the run")
    entry_point: Name | None = Field(
        default=None,
        description='the front door that started the run ("Lightning GeminiStrategy", ...)',
    )
    script: Text | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="the command's script (sys.argv[0])",
    )

    @field_validator("config")
    @classmethod
    def _plain_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(value, allow_nan=False)
        except ValueError as error:
            raise ValueError(f"config must be plain JSON (no NaN or Infinity): {error}") from None
        return value


class MovedBytes(_Strict):
    to_device: NonNegativeInt
    to_host: NonNegativeInt
    # The disk tier's, written and read this step; absent (zero) from runs without one.
    to_disk: NonNegativeInt = 0
    from_disk: NonNegativeInt = 0


class MemoryByPool(_Strict):
    device: NonNegativeInt
    host: NonNegativeInt
    disk: NonNegativeInt = 0


class Step(_Base):
    """One optimizer step on one rank."""

    type: Literal["step"]
    step: NonNegativeInt
    loss: float | None = Field(description="null when not finite or unknown")
    loss_scale: float = Field(ge=0)
    overflow: bool = Field(description="the step was skipped because gradients overflowed")
    grad_norm: float | None
    step_time_s: float = Field(ge=0)
    comm_bytes: dict[Name, NonNegativeInt] = Field(
        max_length=64, description="bytes sent this step per collective kind"
    )
    # Optional: ranks of a shardwise from before quantized communication never send it.
    comm_bytes_unquantized: dict[Name, NonNegativeInt] | None = Field(
        default=None,
        max_length=64,
        description="per collective kind, what this step's collectives would have sent in the "
        "unquantized wire formats (computed by the engine from chunk sizes and dtypes; equal "
        "to comm_bytes when nothing is quantized; null: not reported)",
    )
    moved_bytes: MovedBytes
    memory: MemoryByPool
    # Optional, so that ranks of an older shardwise (which never send them) still validate.
    skipped_in_a_row: NonNegativeInt = Field(
        default=0,
        description="consecutive optimizer steps up to and including this one that were "
        "skipped for non-finite gradients (0 when this step was taken)",
    )
    warning: Text | None = Field(
        default=None,
        max_length=MAX_WARNING_CHARS,
        description="set by the engine once its limit of consecutive skipped steps is crossed",
    )


# A name inside a chunk row, checked by pydantic alone: a snapshot of a thousand ranks' chunks
# arrives at one step, and a Python check per name cost a third of its validation. A lone
# surrogate is refused all the same: pydantic's JSON parser refuses one, and a dict key
# holding one fails strict string validation (tests/dashboard/test_dashboard_api.py).
_RowName = Annotated[str, Field(min_length=1, max_length=128)]


@with_config(ConfigDict(strict=True, extra="forbid"))
class ChunkRow(TypedDict):
    """Where one chunk's buffers live on one rank (a TypedDict: validated without building an
    object per row)."""

    id: NonNegativeInt
    numel: NonNegativeInt
    state: Literal["sharded", "gathered"]
    sharded: bool
    payload: Annotated[Pool, Field(description="pool of the 16-bit payload")]
    optim: Annotated[
        OptimPool | None,
        Field(description="pool of fp32 master and optimizer state (null: frozen)"),
    ]
    tensor_states: Annotated[dict[_RowName, NonNegativeInt], Field(max_length=16)]


class Chunks(_Base):
    """A snapshot of every chunk on one rank."""

    type: Literal["chunks"]
    step: NonNegativeInt
    chunks: list[ChunkRow] = Field(max_length=MAX_CHUNKS_PER_SNAPSHOT)


class Eval(_Base):
    """An evaluation on one rank: its loss, after an optimizer step."""

    type: Literal["eval"]
    step: NonNegativeInt = Field(description="index of the optimizer step it followed")
    loss: float | None = Field(description="the evaluation loss; null when not finite")


class RunFinished(_Base):
    """A rank left a run, cleanly or not."""

    type: Literal["run_finished"]
    status: Literal["finished", "failed"]
    error: Text | None = Field(max_length=2000)


class Dropped(_Base):
    """Events a rank's emitter could not deliver."""

    type: Literal["dropped"]
    count: NonNegativeInt


Event = Annotated[
    RunStarted | Step | Chunks | Eval | RunFinished | Dropped, Field(discriminator="type")
]


class EventBatch(_Strict):
    """The body of POST /api/v1/events."""

    events: list[Event] = Field(min_length=1, max_length=MAX_EVENTS_PER_BATCH)
