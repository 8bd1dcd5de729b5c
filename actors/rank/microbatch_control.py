"""`MicrobatchControl`: a rank's micro-batching decision for each step of its DP×EP group.

Every rank runs its own copy of the micro-batch policy (`policies/microbatch.py`) on what
the group agreed: the step's largest token count and whether it runs eager, and the
previous step's time, the slowest rank's (each rank sends its own in the step's
agreement, which takes the maximum). Same inputs in the same order on every rank, so every
rank splits the same way without another message (ARCHITECTURE §3).

Micro-batching applies to every exchange: eager steps over `GroupComm` ("exact",
"padded"; on GPU the exchanges on a stream of their own, `comm/exchange_worker.py`),
steps over the peer channels (each micro-batch on its lane, `engine/lanes.py`) and the
group's captured decode graphs (their split set); a step that cannot split (a graph size
of one row) runs one batch. Stats: steps split, and per token-count bucket the mean step
time of each choice as this rank measured it.
"""

from __future__ import annotations

import time
from typing import Optional

from ...config import MicrobatchConfig
from ...policies.microbatch import StepShape, bucket_of, make_microbatch_policy

__all__ = ["MicrobatchControl"]

US_MAX = (1 << 32) - 1  # the agreement carries values below 2**32


class MicrobatchControl:
    """The policy, the step being measured, and what was measured."""

    def __init__(self, config: MicrobatchConfig, ep_width: int, enabled: bool) -> None:
        self.policy = make_microbatch_policy(config.policy, config.policy_config())
        self.ep_width, self.enabled = ep_width, enabled
        self._last_us = 0  # this rank's last step, sent with the next agreement
        self._pending: Optional[tuple[StepShape, int]] = None  # the step awaiting its time
        self._started = 0.0
        self.split_steps = 0
        self.steps = 0
        self._times: dict[tuple[int, int], list[float]] = {}  # (bucket, n) -> [count, seconds]

    def outgoing(self) -> int:
        """This rank's last step in µs, for the agreement (0 once sent)."""
        out, self._last_us = self._last_us, 0
        return out

    def observe(self, agreed_last_us: int) -> None:
        """After every agreement: the policy learns what the previous step cost (the
        group's time) once it arrives."""
        if self._pending is not None and agreed_last_us > 0:
            shape, n = self._pending
            self.policy.observe(shape, n, agreed_last_us / 1e6)
            self._pending = None

    def decide(self, tokens: int, eager: bool, splittable: bool = True) -> int:
        """1 or 2 micro-batches for the step the group agreed on (1 where it cannot split)."""
        if not self.enabled or not splittable:
            return 1
        return self.policy.decide(StepShape(tokens, eager, self.ep_width))

    def start(self) -> None:
        self._started = time.perf_counter()

    def finish(self, tokens: int, eager: bool, microbatches: int) -> None:
        """The step ran: its time is sent with the next agreement and recorded."""
        seconds = time.perf_counter() - self._started
        self._last_us = min(US_MAX, max(1, int(seconds * 1e6)))
        if self.enabled:
            self._pending = (StepShape(tokens, eager, self.ep_width), microbatches)
        self.steps += 1
        self.split_steps += microbatches == 2
        entry = self._times.setdefault((bucket_of(tokens), microbatches), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def stats(self) -> dict:
        """`microbatch_steps` / `microbatch_split_steps`, `microbatch_step_ms`:
        {"<bucket>:<n>": mean ms} and `microbatch_step_counts`: {"<bucket>:<n>": steps}
        (bucket b: steps of 2**(b-1)+1 .. 2**b tokens a rank)."""
        times = sorted(self._times.items())
        return {"microbatch_steps": self.steps, "microbatch_split_steps": self.split_steps,
                "microbatch_step_ms": {f"{b}:{n}": round(total / count * 1e3, 4)
                                       for (b, n), (count, total) in times},
                "microbatch_step_counts": {f"{b}:{n}": count for (b, n), (count, _) in times}}
