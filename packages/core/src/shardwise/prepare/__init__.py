"""A module's parameters before the engine packs them into chunks: parameters left out of
sharding, models built on the meta device, and slices from a `ZeroInitContext`."""
