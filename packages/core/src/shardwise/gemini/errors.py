"""Errors of the memory manager."""


class DeviceBudgetExceeded(RuntimeError):
    """The compute device would hold more bytes than its budget."""
