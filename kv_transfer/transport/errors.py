"""`TransferError`: the one error the KV transport raises for a failed transfer."""

from __future__ import annotations

__all__ = ["TransferError"]


class TransferError(RuntimeError):
    """A KV transfer failed: timeout, lost or rejecting peer, broken connection.
    Fields: request_id ('' for a connection-level failure), epoch, peer, detail."""

    def __init__(self, request_id: str, epoch: int, peer: str, detail: str) -> None:
        self.request_id, self.epoch, self.peer, self.detail = request_id, epoch, peer, detail
        super().__init__(f"KV transfer of request {request_id!r} (epoch {epoch}) "
                         f"with {peer}: {detail}")

    def __reduce__(self):  # crosses Ray: rebuild from the fields
        return (TransferError, (self.request_id, self.epoch, self.peer, self.detail))
