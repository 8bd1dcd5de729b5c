"""Failure handling of the disaggregated layout (ARCHITECTURE §5), mixed into
`DisaggClient`: every failed call is reported to the recovery loop (`Recovery`, over
the reconciler), which fences the group it belongs to, re-forms it under a new epoch
and resumes it from `poll`; what each group's fence and resume do to the requests is
here.

- Prefill instance fenced: its requests' decode gates close and their decode pages are
  returned, then they are prefilled again from the same prompt (their first token, if
  the caller already has it, is not emitted twice: the same seed gives the same token).
- Decode group fenced (one of the decode side's DP×EP groups, `DPGroups`): requests
  being prefilled for it are withdrawn from the prefill side (their held pages freed);
  requests it was decoding resume from prompt + the tokens the caller already has, on the
  group their DP rank lives in once it serves: sampling is seeded per (request,
  position), so the continuation is the one the lost group would have produced, and the
  output index of each new token continues where the caller stopped. A layout change of
  the EP-width policy fences the same way (planned).
- A request aborted while prefilling goes through a prefill failure's stages without the
  requeue, moved on by the polls (`_abort_cleanup`, `_advance_aborts`).
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from .rank.spec import RankFailure
from ..log import get_logger
from .abort_cleanup import AbortCleanup, Stage
from .resume import resume_from
from .supervisor import settle

log = get_logger(__name__)

CALL_ERRORS = (RankFailure, RayActorError, GetTimeoutError)
DECODE = "decode"  # the prefix of the decode groups' keys: decode0, decode1, ...


def is_decode_key(key) -> bool:
    return isinstance(key, str) and key.startswith(DECODE)


def prefill_key(index: int) -> tuple[str, int]:
    return ("prefill", index)


def _running(refs: list) -> list:
    """The refs whose calls have not returned yet."""
    return ray.wait(refs, num_returns=len(refs), timeout=0)[1]


class DecodeLost(RuntimeError):
    """The decode group failed during a call (reported to the recovery loop); the call's
    work is void: the group's fence takes its requests back."""


class DisaggRecovery:
    """Recovery methods of `DisaggClient` (state and helpers live there)."""

    def _decode_call(self, key: str, fn):
        """Run a call on decode group `key`; on a failure, report the group lost and
        raise `DecodeLost` (also when it is down already)."""
        epoch = self.decodes.by_key[key].epoch
        if not self.recovery.serving(key):
            raise DecodeLost(f"{key} epoch {epoch} is down")
        try:
            return fn()
        except CALL_ERRORS as e:
            self.recovery.lost(key, epoch, e)
            raise DecodeLost(f"{key} epoch {epoch} failed") from e

    def _abandon(self, req, instance_alive: bool) -> None:
        """Give up this prefill attempt: its prefill ranks stop streaming it (what they
        announced is withdrawn, which ends the receives the decode ranks posted for it),
        the gates are closed (which waits for receives into its pages still running),
        the decode pages are returned, then the prefill pages; the request goes back to
        the front of the queue (unless it was aborted)."""
        if instance_alive:
            self._stop_streaming(req)
        ranks, leader = self._decode_ranks(req), self._decode_leader(req)
        self._decode_call(req.dkey, lambda: ray.get([r.close_gate.remote(req.transfer_id)
                                                     for r in ranks]))
        self._decode_call(req.dkey, lambda: ray.get(leader.unreserve.remote(req.request_id)))
        if instance_alive:
            self.prefill[req.instance].leaders[0].abort.remote(req.request_id)
        self._requeue(req)

    def _abort_cleanup(self, req) -> AbortCleanup:
        """`_abandon`'s stages for an aborted attempt, the first one issued now (the
        decode group serves; an instance that is down has nothing left to forget)."""
        group, ranks = self.prefill[req.instance], self._decode_ranks(req)
        leader = self._decode_leader(req)
        alive = self.recovery.serving(prefill_key(req.instance))
        prefill = list(group.actors) if alive else []

        def release() -> list:
            if prefill:
                prefill[0].abort.remote(req.request_id)
            return [leader.unreserve.remote(req.request_id)]

        return AbortCleanup(req.request_id, (req.dkey, self.decodes.by_key[req.dkey].epoch), [
            Stage("forget", lambda: [a.forget.remote(req.key) for a in prefill],
                  group.deadline_s),
            Stage("gates", lambda: [r.close_gate.remote(req.transfer_id) for r in ranks], None),
            Stage("pages", release, None)])

    def _advance_aborts(self) -> None:
        """Move every abort's cleanup on; a stage's failed decode call replaces the
        decode group (`DecodeLost`), which ends the cleanups of its epoch: its pages and
        gates went with it."""
        for rid, cleanup in list(self._aborting.items()):
            key, epoch = cleanup.epoch
            if epoch != self.decodes.by_key[key].epoch:
                del self._aborting[rid]
                continue
            for name, handles, late in cleanup.advance(_running):
                running = set(_running(handles)) if late else set()
                done = [h for h in handles if h not in running]
                if name == "forget":
                    error = "no answer within the deadline" if late else ""
                    try:
                        ray.get(done)
                    except Exception as e:  # noqa: BLE001 - a dead instance is fenced by the recovery loop
                        error = str(e)[:200]
                    if error:
                        log.warning("prefill_forget_failed", request_id=rid, error=error)
                else:
                    self._decode_call(key, lambda: ray.get(done))
            if cleanup.done:
                del self._aborting[rid]

    def _stop_streaming(self, req) -> None:
        """Every rank of `req`'s prefill instance forgets its stream; returns once they
        have (their announced messages withdrawn). A rank that fails meanwhile is left to
        the next poll, which replaces its instance."""
        group = self.prefill[req.instance]
        try:
            ray.get([a.forget.remote(req.key) for a in group.actors], timeout=group.deadline_s)
        except Exception as e:  # noqa: BLE001 - a dead instance is fenced by the recovery loop
            log.warning("prefill_forget_failed", instance=req.instance, epoch=group.epoch,
                        request_id=req.request_id, error=str(e)[:200])

    def _withdraw_prefill(self, req) -> None:
        """Stop the prefill side of `req`'s attempt: no more streaming, pages freed
        (nothing to do on an instance that is down: its actors are gone)."""
        if not self.recovery.serving(prefill_key(req.instance)):
            return
        group = self.prefill[req.instance]
        for a in group.actors:
            a.forget.remote(req.key)
        group.leaders[0].abort.remote(req.request_id)

    def _requeue(self, req) -> None:
        req.state, req.transfer_id, req.sent, req.first = "queued", "", set(), None
        if req.request_id in self._reqs and req.request_id not in self._queue:
            self._queue.appendleft(req.request_id)

    def _fence_prefill(self, index: int) -> None:
        """Instance `index` is gone (its actors killed): its answers are void and its
        requests are prefilled again, each after its decode gates closed and its decode
        pages came back (unless the decode group is down too: its fence takes them)."""
        settle(ref for ref, tag in self._pending.items() if tag[0] == "prefill" and tag[1] == index)
        self._pending = {ref: tag for ref, tag in self._pending.items()
                         if not (tag[0] == "prefill" and tag[1] == index)}
        lost = sorted((r for r in self._reqs.values()
                       if r.state == "prefill" and r.instance == index),
                      key=lambda r: r.arrival, reverse=True)
        for req in lost:
            try:
                self._abandon(req, instance_alive=False)
            except DecodeLost:
                return  # the decode group's fence takes back the rest

    def _fence_decode(self, key: str) -> None:
        """Decode group `key` is gone: requeue what it held, in arrival order (those being
        prefilled for it are withdrawn from their prefill instance first)."""
        mine = lambda tag: tag[0] == "decode" and tag[1] == key  # noqa: E731
        settle(ref for ref, tag in self._pending.items() if mine(tag))
        self._pending = {ref: tag for ref, tag in self._pending.items() if not mine(tag)}
        held = sorted((r for r in self._reqs.values()
                       if r.dkey == key and r.state in ("prefill", "decode")),
                      key=lambda r: r.arrival, reverse=True)
        for req in held:
            if req.state == "prefill":
                self._withdraw_prefill(req)
            else:
                self._resume(req)
            self._requeue(req)
        for req in self._reqs.values():  # placed again once their group serves
            if req.dkey == key:
                req.dkey, req.local, req.dp_rank = None, -1, -1
        for rid, cleanup in list(self._aborting.items()):
            if cleanup.epoch[0] == key:  # their pages and gates went with the group
                del self._aborting[rid]

    def _on_fence(self, key) -> None:
        if is_decode_key(key):
            self._fence_decode(key)
        else:
            self._fence_prefill(key[1])

    def _on_resume(self, key) -> None:
        if is_decode_key(key):
            self.ep.settle()  # the EP-width policy waits for the steady state
            self._learn_decode_layout(key)

    def _resume(self, req) -> None:
        """Continue `req` from its prompt + the tokens the caller already has."""
        req.tokens, req.params, req.base = resume_from(req.prompt, req.params_in, req.emitted)
