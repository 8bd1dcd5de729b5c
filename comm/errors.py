"""The one error of a collective or exchange: every wait in `comm` ends in a result or
this, within its deadline (ARCHITECTURE §5)."""

from __future__ import annotations

__all__ = ["CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective failed, timed out, or was called on a broken communicator.

    Fields: ``op`` (the collective's name), ``epoch`` and ``rank`` of the communicator.
    The torch.distributed exception, when there is one, is the ``__cause__``.
    """

    def __init__(self, op: str, epoch: int, rank: int, detail: str = "") -> None:
        self.op = op
        self.epoch = epoch
        self.rank = rank
        msg = f"collective {op!r} failed on rank {rank} (epoch {epoch})"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.detail = detail

    def __reduce__(self):  # crosses Ray (actor method errors): rebuild from the fields
        return (CollectiveError, (self.op, self.epoch, self.rank, self.detail))
