"""`colossalai.nn`'s path: the optimizers a ColossalAI script imports."""
