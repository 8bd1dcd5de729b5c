"""Failure handling of the disaggregated layout (ARCHITECTURE §5), mixed into
`DisaggClient`: a prefill instance or the decode group that loses a rank is replaced
under a new epoch, and every request it held goes back to the queue.

- Prefill instance lost: its requests' decode gates close and their decode pages are
  returned, then they are prefilled again from the same prompt (their first token, if
  the caller already has it, is not emitted twice: the same seed gives the same token).
- Decode group lost: requests being prefilled for it are withdrawn from the prefill side
  (their held pages freed); requests it was decoding resume from prompt + the tokens the
  caller already has, on the re-formed group: sampling is seeded per (request, position),
  so the continuation is the one the lost group would have produced, and the output
  index of each new token continues where the caller stopped.
- A request aborted while prefilling goes through a prefill failure's stages without the
  requeue, moved on by the polls (`_abort_cleanup`, `_advance_aborts`).
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ..engine.rank_spec import RankFailure
from ..log import get_logger
from .abort_cleanup import AbortCleanup, Stage
from .resume import resume_from
from .supervisor import GroupFailure, settle

log = get_logger(__name__)

ACTOR_ERRORS = (RankFailure, RayActorError)


def _running(refs: list) -> list:
    """The refs whose calls have not returned yet."""
    return ray.wait(refs, num_returns=len(refs), timeout=0)[1]


class DecodeLost(RuntimeError):
    """The decode group failed during a call and was replaced; the call's work is void
    (its requests were put back in the queue by the recovery)."""


class DisaggRecovery:
    """Recovery methods of `DisaggClient` (state and helpers live there)."""

    def _decode_call(self, fn):
        """Run a call on the decode group; on a rank failure, replace the group and
        raise `DecodeLost`."""
        try:
            return fn()
        except ACTOR_ERRORS as e:
            self._recover_decode(e)
            raise DecodeLost(f"decode group epoch {self.decode.epoch - 1} failed") from e

    def _abandon(self, req, instance_alive: bool) -> None:
        """Give up this prefill attempt: its prefill ranks stop streaming it (what they
        announced is withdrawn, which ends the receives the decode ranks posted for it),
        the gates are closed (which waits for receives into its pages still running),
        the decode pages are returned, then the prefill pages; the request goes back to
        the front of the queue (unless it was aborted)."""
        if instance_alive:
            self._stop_streaming(req)
        ranks = self._decode_ranks(req.dp_rank)
        self._decode_call(lambda: ray.get([r.close_gate.remote(req.transfer_id) for r in ranks]))
        leader = self.decode.leaders[req.dp_rank]
        self._decode_call(lambda: ray.get(leader.unreserve.remote(req.request_id)))
        if instance_alive:
            self.prefill[req.instance].leaders[0].abort.remote(req.request_id)
        self._requeue(req)

    def _abort_cleanup(self, req) -> AbortCleanup:
        """`_abandon`'s stages for an aborted attempt, the first one issued now."""
        group, ranks = self.prefill[req.instance], self._decode_ranks(req.dp_rank)
        leader = self.decode.leaders[req.dp_rank]

        def release() -> list:
            group.leaders[0].abort.remote(req.request_id)
            return [leader.unreserve.remote(req.request_id)]

        return AbortCleanup(req.request_id, self.decode.epoch, [
            Stage("forget", lambda: [a.forget.remote(req.key) for a in group.actors],
                  group.deadline_s),
            Stage("gates", lambda: [r.close_gate.remote(req.transfer_id) for r in ranks], None),
            Stage("pages", release, None)])

    def _advance_aborts(self) -> None:
        """Move every abort's cleanup on; a stage's failed decode call replaces the
        decode group (`DecodeLost`), which ends the cleanups of its epoch: its pages and
        gates went with it."""
        for rid, cleanup in list(self._aborting.items()):
            if cleanup.epoch != self.decode.epoch:
                del self._aborting[rid]
                continue
            for name, handles, late in cleanup.advance(_running):
                running = set(_running(handles)) if late else set()
                done = [h for h in handles if h not in running]
                if name == "forget":
                    error = "no answer within the deadline" if late else ""
                    try:
                        ray.get(done)
                    except ACTOR_ERRORS as e:  # the next poll replaces the instance
                        error = str(e)[:200]
                    if error:
                        log.warning("prefill_forget_failed", request_id=rid, error=error)
                else:
                    self._decode_call(lambda: ray.get(done))
            if cleanup.done:
                del self._aborting[rid]

    def _stop_streaming(self, req) -> None:
        """Every rank of `req`'s prefill instance forgets its stream; returns once they
        have (their announced messages withdrawn). A rank that fails meanwhile is left to
        the next poll, which replaces its instance."""
        group = self.prefill[req.instance]
        try:
            ray.get([a.forget.remote(req.key) for a in group.actors], timeout=group.deadline_s)
        except (*ACTOR_ERRORS, GetTimeoutError) as e:
            log.warning("prefill_forget_failed", instance=req.instance, epoch=group.epoch,
                        request_id=req.request_id, error=str(e)[:200])

    def _withdraw_prefill(self, req) -> None:
        """Stop the prefill side of `req`'s attempt: no more streaming, pages freed."""
        group = self.prefill[req.instance]
        for a in group.actors:
            a.forget.remote(req.key)
        group.leaders[0].abort.remote(req.request_id)

    def _requeue(self, req) -> None:
        req.state, req.transfer_id, req.sent, req.first = "queued", "", set(), None
        if req.request_id in self._reqs and req.request_id not in self._queue:
            self._queue.appendleft(req.request_id)

    def _recover_prefill(self, index: int) -> None:
        """Replace a failed prefill instance (new epoch) and prefill its requests again.
        Past `max_recoveries` replacements per instance (over all instances) the layout
        gives up: `GroupFailure`."""
        group = self.prefill[index]
        deaths = group.deaths()
        log.warning("prefill_recovery", instance=index, epoch=group.epoch,
                    deaths=[(d.rank, d.reason[:120]) for d in deaths])
        if self.recoveries >= self.config.parallel.max_recoveries * len(self.prefill):
            # Every rank's end, so that a dead one is named even when a survivor's own
            # failure (which saw it go) reached us before Ray's report of its death.
            raise GroupFailure(group.epoch, group.wait_for_failure(
                min(group.deadline_s + 5.0, 30.0)) or deaths)
        group.shutdown()
        settle(ref for ref, tag in self._pending.items() if tag[0] == "prefill" and tag[1] == index)
        self._pending = {ref: tag for ref, tag in self._pending.items()
                         if not (tag[0] == "prefill" and tag[1] == index)}
        lost = sorted((r for r in self._reqs.values()
                       if r.state == "prefill" and r.instance == index),
                      key=lambda r: r.arrival, reverse=True)
        for req in lost:
            self._abandon(req, instance_alive=False)
        group.form()
        self.recoveries += 1

    def _recover_decode(self, error: BaseException) -> None:
        """Replace the decode group (new epoch); requeue what it held, in arrival order."""
        group = self.decode
        deaths = group.wait_for_failure(min(group.deadline_s + 5.0, 30.0))
        log.warning("decode_recovery", epoch=group.epoch, error=str(error)[:200],
                    deaths=[(d.rank, d.reason[:120]) for d in deaths])
        if self.decode_recoveries >= self.config.parallel.max_recoveries:
            raise GroupFailure(group.epoch, deaths) from error
        group.shutdown()
        settle(ref for ref, tag in self._pending.items() if tag[0] == "decode")
        self._pending = {ref: tag for ref, tag in self._pending.items() if tag[0] != "decode"}
        held = sorted((r for r in self._reqs.values() if r.state in ("prefill", "decode")),
                      key=lambda r: r.arrival, reverse=True)
        for req in held:
            if req.state == "prefill":
                self._withdraw_prefill(req)
            else:
                self._resume(req)
            req.dp_rank = -1  # placed again on the new group
            self._requeue(req)
        group.form()
        self._learn_decode_layout()
        self.decode_recoveries += 1

    def _resume(self, req) -> None:
        """Continue `req` from its prompt + the tokens the caller already has."""
        req.tokens, req.params, req.base = resume_from(req.prompt, req.params_in, req.emitted)
