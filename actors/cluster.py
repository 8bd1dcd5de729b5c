"""The contract between whoever drives a multi-rank layout (the server's driver thread,
the offline `LLM`) and the layout; `cluster_builder.build_cluster` builds one.

`ClusterClient` is what `GroupClient` (one colocated TP or DP×EP group) and
`DisaggClient` (prefill instances streaming KV to a decode group) both are. One thread
calls a client (none of it is thread-safe). Recovery from rank deaths happens inside
(`Recovery`): a caller sees outputs continue, each output index once, or, past the
restart intensity, a `GroupFailure` from `poll`, `maintain` and the views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from ..engine.outputs import StepOutput
from ..engine.sampling_params import SamplingParams

__all__ = ["Placement", "ClusterClient"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: its decode (or colocated) DP group and, disaggregated, its
    prefill instance; -1 leaves the choice to the client (round robin). While a group
    serves narrower than configured, a DP group index wraps around its width; while a
    prefill instance is down, the next serving one stands in."""

    dp_group: int = -1
    prefill_instance: int = -1


ANYWHERE = Placement()


@runtime_checkable
class ClusterClient(Protocol):
    def submit(self, request_id: str, tokens: Sequence[int], params: SamplingParams,
               placement: Placement = ANYWHERE) -> None:
        """Start a request (ValueError naming what is wrong with it: a bad prompt, an
        id in use). The request runs until it finishes or is aborted."""

    def poll(self) -> list[StepOutput]:
        """Outputs since the last call (waits ~50 ms at most); each carries `index`, the
        position of its first token in the request's output."""

    def abort(self, request_id: str) -> None:
        """Stop a request; never waits on a rank. Unknown ids are ignored."""

    def maintain(self) -> None:
        """Recovery work due while nothing is polled (fence a dead group, widen one)."""

    def topology(self) -> dict:
        """What a router places over: `dp`, `prefill_instances`, `page_size`,
        `prefill_page_size`, `num_pages`, `prefill_num_pages`."""

    def leader_stats(self) -> dict:
        """`{"decode": [...], "prefill": [...], "recoveries": n, "width": n, ...}`;
        TimeoutError while a group re-forms (ask again later)."""

    def held_prefixes(self) -> dict:
        """The page hashes each leader's KV pool holds (`held_reports`)."""

    def rank_nodes(self) -> dict:
        """`{"decode": [node id per rank], "prefill": [[...] per instance]}`."""

    def close(self) -> None:
        """Stop every rank actor."""
