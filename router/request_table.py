"""The router's table of live and recently ended requests, keyed by request id.

Contract: a request id names at most one record at a time (`add` of an id in the table
raises `DuplicateRequestError`); `get` of an unknown id raises KeyError naming it;
`remove` is idempotent (returns None for an unknown id). The table does not drive
transitions; records do (`RequestRecord.accept`, `abort`, ...).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Hashable, Iterator, Optional, Sequence

from .request import RequestRecord, RequestState


class DuplicateRequestError(ValueError):
    """A request id that is already in the table."""


class RequestTable:
    """Records by id, in arrival order. `seed_rng` pins the seeds of requests created
    through `create` (default: the system's random source)."""

    def __init__(self, seed_rng: Optional[random.Random] = None) -> None:
        self._records: dict[str, RequestRecord] = {}
        self._seed_rng = seed_rng

    def create(self, request_id: str, prompt_token_ids: Sequence[int],
               sampling_params: Any = None) -> RequestRecord:
        """Builds a record (seed pinned) and adds it; `DuplicateRequestError` on a live id
        (checked before anything is built)."""
        self._check_new(request_id)
        record = RequestRecord(request_id, tuple(prompt_token_ids), sampling_params,
                               self._seed_rng)
        self._records[request_id] = record
        return record

    def add(self, record: RequestRecord) -> RequestRecord:
        self._check_new(record.request_id)
        self._records[record.request_id] = record
        return record

    def _check_new(self, request_id: str) -> None:
        if request_id in self._records:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")

    def get(self, request_id: str) -> RequestRecord:
        try:
            return self._records[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def find(self, request_id: str) -> Optional[RequestRecord]:
        return self._records.get(request_id)

    def remove(self, request_id: str) -> Optional[RequestRecord]:
        return self._records.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def count_by_state(self) -> dict[RequestState, int]:
        """Number of records in each state (every state present, zeros included)."""
        counts = Counter(r.state for r in self._records.values())
        return {s: counts.get(s, 0) for s in RequestState}

    def in_state(self, *states: RequestState) -> list[RequestRecord]:
        return [r for r in self._records.values() if r.state in states]

    def live(self) -> list[RequestRecord]:
        """Records that have not ended, in arrival order."""
        return [r for r in self._records.values() if not r.state.terminal]

    def on_group(self, dp_group: Hashable) -> list[RequestRecord]:
        """Live records placed on DP group `dp_group` (those to recover when it dies)."""
        return [r for r in self._records.values()
                if not r.state.terminal and r.dp_group == dp_group]

    def on_prefill_instance(self, instance: Hashable) -> list[RequestRecord]:
        return [r for r in self._records.values()
                if not r.state.terminal and r.prefill_instance == instance]


__all__ = ["DuplicateRequestError", "RequestTable"]
