"""Where chunks live: the placement policy over a chunk manager."""

from __future__ import annotations

from shardwise.chunk import ChunkManager

PLACEMENT_POLICIES = ("cuda", "device", "cpu", "static", "auto")
_IMPLEMENTED_POLICIES = ("cuda", "device")


class GeminiManager:
    """Decides where each chunk's payload, master weights, gradients and optimizer state live.

    The "cuda" policy (alias "device") keeps everything on the compute device, whatever that
    device is, so it is also the fastest policy on a CPU host.

    Args:
        placement_policy: "cuda" or "device". The offloading policies "cpu", "static" and
            "auto" are refused with an error until their memory manager exists, rather than
            silently behaving like "cuda".
        chunk_manager: the chunks to place.
    """

    def __init__(self, placement_policy: str, chunk_manager: ChunkManager) -> None:
        if not isinstance(placement_policy, str):
            raise TypeError(f"placement_policy must be a str, got {placement_policy!r}")
        if placement_policy not in PLACEMENT_POLICIES:
            raise ValueError(
                f"placement_policy must be one of {', '.join(map(repr, PLACEMENT_POLICIES))}, "
                f"got {placement_policy!r}"
            )
        if placement_policy not in _IMPLEMENTED_POLICIES:
            raise ValueError(
                f"placement_policy {placement_policy!r} (offloading to host memory) is not "
                f"available in this version; use 'cuda' (alias 'device')"
            )
        if not isinstance(chunk_manager, ChunkManager):
            raise TypeError(
                f"chunk_manager must be a ChunkManager, got {type(chunk_manager).__name__}"
            )
        self.placement_policy = "cuda" if placement_policy == "device" else placement_policy
        self.chunk_manager = chunk_manager

    def __repr__(self) -> str:
        return f"GeminiManager(placement_policy={self.placement_policy!r}, {self.chunk_manager!r})"
