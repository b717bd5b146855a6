"""Exceptions users can cause, importable without torch (the CLI and the converters' copy path)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or inconsistent (files and tensors named)."""
