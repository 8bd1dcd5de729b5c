"""The router: places each request on a DP group (and, disaggregated, a prefill instance)
most likely to hold its prefix without overloading it.

It holds two `PlacementPool`s — DP groups and prefill instances — each with its own
prefix tree, load view and policy instance (same policy name by default: prefill
instances are chosen the same way). In the colocated layout there are no prefill
instances and `route_prefill` is not used.

Contract:
- `route(record)` routes from `record.resume_tokens()` (prompt + emitted: after a fault
  the re-prefill runs from there, so the prefix tree is asked about exactly that) and
  records the placement on the record; `route(tokens, request_id=...)` does the same
  for bare tokens. Never blocks; no target -> `NoTargetError` at once.
- A group removed with `remove_group` receives no request from the next call on;
  `remove_group` returns the ids of the requests that were routed there and not yet
  finished, for the caller to recover (requeue and route again).
- `prefill_done(request)` drops the queued part of its load (prefill instance: all of
  it); `finish(request)` drops the rest, in both pools (both idempotent); given a
  record, `finish` also lists prompt + output for its DP group (it now caches them).
- A record's prompt is hashed into pages once per request (per page size): `prepare`
  does it at admission (or the first `route` does), the hashes travel on the record
  (`RequestRecord.page_hashes`) and are reused by `route`, `route_prefill`, a re-route
  after a fault and `finish` (which hashes only the emitted tokens on top).
- The router drives no state transitions of records other than placement, and does no
  I/O: the caller feeds it load snapshots (`update_load`) and held prefixes
  (`refresh_prefixes`) from what ranks report. It is not thread-safe: one thread (or one
  event loop) drives it.
- To move a live request elsewhere without removing its group (e.g. its KV died with a
  rank of a group that re-formed), `finish` it by id (a record would list its tokens
  as cached there), `requeue` the record, and route it again.
"""

from __future__ import annotations

from typing import Any, Collection, Hashable, Iterable, Optional, Sequence, Union

from ..policies import DEFAULT_POLICY, GroupLoad
from .pool import NoTargetError, PlacementPool
from .request import RequestRecord, RequestStateError

DEFAULT_CAPACITY_PAGES = 1 << 16

RequestLike = Union[RequestRecord, Sequence[int]]


def _request_of(request: RequestLike, request_id: Optional[str]) -> tuple[str, Sequence[int]]:
    """(id, tokens to route) of a record or of bare tokens with an id."""
    if isinstance(request, RequestRecord):
        if request.state.terminal:
            raise RequestStateError(f"request {request.request_id} has ended "
                                    f"({request.state.value}); it cannot be routed")
        if request_id is not None and request_id != request.request_id:
            raise ValueError(f"request_id {request_id!r} differs from the record's "
                             f"{request.request_id!r}")
        tokens = request.resume_tokens() if request.output_token_ids else request.prompt_token_ids
        return request.request_id, tokens
    if request_id is None:
        raise TypeError("routing bare tokens needs a request_id (to finish it later)")
    if isinstance(request, (str, bytes)) or not len(request):
        raise ValueError(f"request {request_id!r}: expected a non-empty token sequence")
    return request_id, request


class Router:
    """Placement over DP groups and prefill instances (see the module docstring).

    `page_size` is the DP groups' KV page size, `prefill_page_size` the prefill
    instances' (default: the same); `capacity_pages` bounds each target's tree (set it
    near a target's KV pages). `policy` / `policy_config` name a registered routing
    policy and its config; prefill instances use `prefill_policy` (default: `policy`)
    with `prefill_policy_config` (default: `policy_config` when neither prefill argument
    is given, else the policy's defaults).
    """

    def __init__(self, *, page_size: int = 16, policy: str = DEFAULT_POLICY,
                 policy_config: Any = None, capacity_pages: int = DEFAULT_CAPACITY_PAGES,
                 groups: Iterable[Hashable] = (), prefill_instances: Iterable[Hashable] = (),
                 prefill_page_size: Optional[int] = None, prefill_policy: Optional[str] = None,
                 prefill_policy_config: Any = None) -> None:
        self.decode = PlacementPool(page_size=page_size, capacity_pages=capacity_pages,
                                    policy=policy, policy_config=policy_config, kind="DP group")
        if prefill_policy is None and prefill_policy_config is None:
            prefill_policy, prefill_policy_config = policy, policy_config
        self.prefill = PlacementPool(page_size=prefill_page_size or page_size,
                                     capacity_pages=capacity_pages,
                                     policy=prefill_policy or policy,
                                     policy_config=prefill_policy_config,
                                     kind="prefill instance")
        for g in groups:
            self.add_group(g)
        for p in prefill_instances:
            self.add_prefill_instance(p)

    # ---- DP groups ------------------------------------------------------------------

    @property
    def groups(self) -> list[Hashable]:
        return self.decode.targets

    def add_group(self, group: Hashable, *, capacity_pages: Optional[int] = None,
                  load: Optional[GroupLoad] = None) -> None:
        self.decode.add(group, capacity_pages=capacity_pages, load=load)

    def remove_group(self, group: Hashable) -> list[str]:
        """Takes `group` out of the pool at once; returns the ids of its unfinished requests."""
        return self.decode.remove(group)

    def update_load(self, group: Hashable, load: GroupLoad) -> None:
        self.decode.update_load(group, load)

    def load(self, group: Hashable) -> GroupLoad:
        return self.decode.load(group)

    def loads(self) -> dict[Hashable, GroupLoad]:
        return self.decode.loads()

    def prepare(self, record: RequestRecord) -> RequestRecord:
        """Hashes the pages of `record`'s prompt at the page size of each pool that has
        targets, onto `record.page_hashes` (once; later calls find them there): the
        hashing a request needs, done at admission so that routing it does none."""
        for pool in (self.decode, self.prefill):
            if len(pool):
                self.page_hashes(record, pool)
        return record

    def route(self, request: RequestLike, *, request_id: Optional[str] = None,
              exclude: Collection[Hashable] = ()) -> Hashable:
        """The DP group for a request (a record, or tokens with `request_id`), chosen by
        the policy among the groups not in `exclude`; a record gets `dp_group` set."""
        rid, tokens = _request_of(request, request_id)
        if not isinstance(request, RequestRecord):
            return self.decode.route(rid, tokens, exclude=exclude)
        group = self.decode.route(rid, tokens, exclude=exclude,
                                  hashes=self.page_hashes(request, self.decode))
        request.place(dp_group=group)
        return group

    def refresh_prefixes(self, group: Hashable, held: Collection[int],
                         as_of: Optional[int] = None) -> int:
        """Reconciles `group`'s tree with the page hashes it reports holding; `as_of`:
        `prefix_clock` when the report was requested (later routings are kept)."""
        return self.decode.refresh_prefixes(group, held, as_of)

    def forget_prefixes(self, group: Hashable, evicted: Collection[int],
                        as_of: Optional[int] = None) -> int:
        """Drops the pages `group` reports it evicted since its last report (the
        incremental form of `refresh_prefixes`)."""
        return self.decode.forget_prefixes(group, evicted, as_of)

    @property
    def prefix_clock(self) -> int:
        return self.decode.tree.clock

    def match(self, tokens: Sequence[int]) -> dict[Hashable, int]:
        """Tokens of `tokens` each DP group holds by the tree (read-only)."""
        return self.decode.match(tokens)

    # ---- prefill instances ----------------------------------------------------------

    @property
    def prefill_instances(self) -> list[Hashable]:
        return self.prefill.targets

    def add_prefill_instance(self, instance: Hashable, *, capacity_pages: Optional[int] = None,
                             load: Optional[GroupLoad] = None) -> None:
        self.prefill.add(instance, capacity_pages=capacity_pages, load=load)

    def remove_prefill_instance(self, instance: Hashable) -> list[str]:
        return self.prefill.remove(instance)

    def update_prefill_load(self, instance: Hashable, load: GroupLoad) -> None:
        self.prefill.update_load(instance, load)

    def route_prefill(self, request: RequestLike, *, request_id: Optional[str] = None,
                      exclude: Collection[Hashable] = ()) -> Hashable:
        """The prefill instance for a request, chosen like `route`; a record gets
        `prefill_instance` set. Its load stays until `prefill_done` or `finish`."""
        rid, tokens = _request_of(request, request_id)
        if not isinstance(request, RequestRecord):
            return self.prefill.route(rid, tokens, exclude=exclude)
        instance = self.prefill.route(rid, tokens, exclude=exclude,
                                      hashes=self.page_hashes(request, self.prefill))
        request.place(prefill_instance=instance)
        return instance

    def refresh_prefill_prefixes(self, instance: Hashable, held: Collection[int],
                                 as_of: Optional[int] = None) -> int:
        return self.prefill.refresh_prefixes(instance, held, as_of)

    def forget_prefill_prefixes(self, instance: Hashable, evicted: Collection[int],
                                as_of: Optional[int] = None) -> int:
        return self.prefill.forget_prefixes(instance, evicted, as_of)

    def prefill_done(self, request: Union[RequestRecord, str]) -> bool:
        """The request's prompt is in (first token out, KV handed over): its prefill
        instance's load is dropped, and its DP group keeps only its running request, not
        its queued tokens. Idempotent; True if anything was tracked."""
        rid = request.request_id if isinstance(request, RequestRecord) else request
        on_prefill = self.prefill.release(rid)
        on_decode = self.decode.settle(rid)
        return on_prefill or on_decode

    # ---- both -----------------------------------------------------------------------

    def finish(self, request: Union[RequestRecord, str]) -> bool:
        """Drops the request's load in both pools (idempotent; True if anything was
        tracked). A record's prompt + output are listed for its DP group."""
        if isinstance(request, RequestRecord):
            rid = request.request_id
            on_decode = self.decode.target_of(rid) is not None and \
                self.decode.release(rid, hashes=self.page_hashes(request, self.decode))
        else:
            rid = request
            on_decode = self.decode.release(rid)
        on_prefill = self.prefill.release(rid)
        return on_decode or on_prefill

    @staticmethod
    def page_hashes(record: RequestRecord, pool: PlacementPool) -> Sequence[int]:
        """Chain hashes of `record`'s resume tokens at `pool`'s page size, from the root
        its params name (`prefix_root`: a salted request's; as the engine hashes them):
        the prompt's pages are hashed once per request and page size (kept on the
        record), the emitted tokens' pages (after a fault, or at `finish`) on top."""
        prompt, ps = record.prompt_token_ids, pool.tree.page_size
        root = getattr(record.sampling_params, "prefix_root", None)
        hashes = record.page_hashes.get(ps)
        if hashes is None:
            hashes = record.page_hashes[ps] = pool.tree.hashes(prompt, parent=root)
        out = record.output_token_ids
        if out:
            k = len(hashes)
            tail = [*prompt[k * ps:], *out]
            hashes = hashes + pool.tree.hasher.hashes(tail, parent=hashes[-1] if k else root,
                                                      first_page=k)
        return hashes


__all__ = ["DEFAULT_CAPACITY_PAGES", "NoTargetError", "Router"]
