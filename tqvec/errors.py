"""Exceptions raised by tqvec."""

__all__ = ["FormatError", "BackendUnavailable"]


class FormatError(ValueError):
    """A file is truncated, foreign, corrupted, or written by an incompatible version."""


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend (``"cpu"`` or ``"cuda"``) is not available."""
