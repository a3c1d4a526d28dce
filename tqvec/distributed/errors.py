"""The error a sharded index raises when a shard cannot answer."""

from __future__ import annotations

__all__ = ["ShardError"]


class ShardError(RuntimeError):
    """A shard's actor died past its restarts, or restarted without rows it held (changes
    made since the index was last saved). ``shards`` names them."""

    def __init__(self, message: str, shards: list[int]):
        super().__init__(message)
        self.shards = shards

    def __reduce__(self):  # rebuilt across processes with its shards
        return (type(self), (self.args[0], self.shards))
