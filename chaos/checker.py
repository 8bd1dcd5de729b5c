"""The Jepsen-style check of a drill: each request's streamed tokens against its
fault-free reference (the same server before the faults). Plain logic.

Verdicts (`Verdict.kind`):
- `ok`: the tokens equal the reference's (a stream the client cut off: a prefix of it);
- `lost`: some reference tokens never arrived (the rest in order);
- `duplicated`: a token arrived twice (the reference in order within what arrived);
- `reordered`: the same tokens in another order;
- `changed`: anything else (a different token);
- `gave-up`: the stream ended with a clean 503 after the service gave up (the recovery
  intensity was exceeded) and what arrived before it is a prefix of the reference;
- `error`: any other error (a 503 while the service still served, a 5xx, a broken stream).
Only `ok` and `gave-up` pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = ["PASSING", "Verdict", "check_stream"]

PASSING = ("ok", "gave-up")


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str
    expected: int  # tokens the reference (or the prefix the client kept) has
    received: int
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.kind in PASSING


def _subsequence(short: Sequence[int], long: Sequence[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def _compare(got: list[int], want: list[int]) -> Verdict:
    n, m = len(want), len(got)
    if got == want:
        return Verdict("ok", n, m)
    if Counter(got) == Counter(want):
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        return Verdict("reordered", n, m, f"from token {first}")
    if m < n and _subsequence(got, want):
        return Verdict("lost", n, m, f"{n - m} token(s) missing")
    if m > n and _subsequence(want, got):
        return Verdict("duplicated", n, m, f"{m - n} token(s) extra")
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(n, m))
    return Verdict("changed", n, m, f"differs from token {first}")


def check_stream(reference: Sequence[int], chunks: Sequence[Sequence[int]],
                 error: Optional[tuple[Optional[int], str]] = None, cut_off: bool = False,
                 service_gave_up: bool = False) -> Verdict:
    """`chunks`: the token ids of each chunk as they arrived; `error`: (HTTP status,
    code) of the error that ended the stream; `cut_off`: the client stopped reading
    early (on purpose); `service_gave_up`: the server reported it stopped serving."""
    got = [t for c in chunks for t in c]
    want = list(reference)
    if error is not None:
        status, code = error
        prefix = _compare(got, want[:len(got)])
        if not prefix.passed:
            return prefix
        if status == 503 and service_gave_up:
            return Verdict("gave-up", len(want), len(got), code)
        return Verdict("error", len(want), len(got), f"{status} {code}")
    if cut_off:
        return _compare(got, want[:len(got)])
    return _compare(got, want)
