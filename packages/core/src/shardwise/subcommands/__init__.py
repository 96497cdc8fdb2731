"""The `shardwise` command's sub-commands, one module each (plan.py, consolidate.py); cli.py
builds the parser from them and dispatches.

Nothing here imports torch when it is imported: torch is imported inside the functions that run
a sub-command, so that `shardwise --version` and `--help` answer at once.
"""
