"""The thread that owns one multi-rank client and the router.

A multi-rank client (`actors.cluster.ClusterClient`: `GroupClient`, `DisaggClient`)
and a `Router` are not thread-safe: every call on either happens on this thread. Other threads only enqueue commands (`submit`, `abort`, `stop`) and read
the `stats` snapshot the thread publishes (a fresh dict each time, never mutated); the
inbox and the thread's lifecycle are `OwnerThread`'s (owner_thread.py).

The loop: drain the inbox (blocking while no request is live, up to the next
refresh); `poll()` the client while requests are live; pass each `StepOutput`
through its request's `RequestRecord.accept` and hand the sink the resulting
`TokenDelta`s — each output index exactly once, in order, nothing after the end;
every `load_interval_s` feed the router the DP leaders' load, every
`prefix_interval_s` the page hashes they hold.

Placement: at submit the router picks the DP group (and, disaggregated, the prefill
instance), handed to the client's `submit` as a `Placement`. With admission on
(`DriverConfig.admission`, router/admission.py) a request first waits here until a DP
group has room, and is placed then (after each poll, refresh and submit); an abort of a
held request ends it here, and a failure ends the held ones with the live ones.

Indexes: a `StepOutput` that carries an `index` attribute (the output position of its
first token) is accepted at that index, so a replayed or duplicated output is dropped
and a gap fails its request; one without it continues at the record's next index (the
clients deliver each token once, in order, and fence stale epochs themselves).

Failures: a `ValueError` from `client.submit` refuses that request (the sink's
`on_error`, a 400 upstream). A rank's death is the client's business: its recovery
loop re-forms the group inside `poll` and the requests continue (each output index
once). Only when the client gives up (`GroupFailure`: the restart intensity is
exceeded) does an exception reach this thread: every live request ends through the
sink's `on_failure`, later submits are refused with the same error, and the thread
waits for `stop`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Protocol

from ..actors.cluster import Placement
from ..engine.outputs import StepOutput
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from ..policies import DEFAULT_POLICY, GroupLoad
from ..router import RequestRecord, Router
from ..router.admission import Admission, AdmissionConfig
from .backend import TokenDelta
from .cluster_stats import summarize
from .owner_thread import STOP, OwnerThread

log = get_logger(__name__)

__all__ = ["ClusterLayout", "DriverConfig", "DriverSink", "ClusterDriver", "make_router"]


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """What the router places over: `dp` DP groups (ids 0..dp-1), `prefill_instances`
    (ids 0..n-1; 0: colocated), each side's KV page size and its leaders' fewest KV
    pages (0: unknown; bounds the router's prefix tree per target)."""

    dp: int
    prefill_instances: int = 0
    page_size: int = 16
    prefill_page_size: int = 16
    num_pages: int = 0
    prefill_num_pages: int = 0

    def __post_init__(self) -> None:
        if self.dp < 1 or self.prefill_instances < 0:
            raise ValueError(f"ClusterLayout: dp >= 1 and prefill_instances >= 0 required, "
                             f"got {self.dp}, {self.prefill_instances}")
        if self.page_size < 1 or self.prefill_page_size < 1:
            raise ValueError("ClusterLayout: page sizes must be positive")

    @classmethod
    def of(cls, client: Any) -> "ClusterLayout":
        """From `client.topology()` (keys this class does not know are ignored)."""
        topo = client.topology()
        return cls(**{f.name: int(topo[f.name]) for f in fields(cls) if f.name in topo})


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """Refresh periods, the routing policy (a name registered in `policies`, with its
    config: a dataclass, a mapping of its fields, or None for the defaults) and when
    requests wait at the router (`AdmissionConfig`, or a mapping of its fields)."""

    load_interval_s: float = 0.5
    prefix_interval_s: float = 2.0
    policy: str = DEFAULT_POLICY
    policy_config: Any = None
    admission: AdmissionConfig = AdmissionConfig()

    def __post_init__(self) -> None:
        if not (self.load_interval_s > 0 and self.prefix_interval_s > 0):
            raise ValueError("DriverConfig: refresh intervals must be positive")
        if isinstance(self.admission, dict):
            object.__setattr__(self, "admission", AdmissionConfig(**self.admission))
        if not isinstance(self.admission, AdmissionConfig):
            raise TypeError(f"DriverConfig.admission: expected an AdmissionConfig or a mapping, "
                            f"got {type(self.admission).__name__}")


class DriverSink(Protocol):
    """Receives what the driver produces; called on the driver thread, must not block."""

    def on_deltas(self, deltas: list[tuple[str, TokenDelta]]) -> None: ...

    def on_error(self, request_id: str, error: Exception) -> None: ...

    def on_failure(self, error: BaseException) -> None: ...


def make_router(layout: ClusterLayout, config: DriverConfig = DriverConfig()) -> Router:
    """A router over the layout's DP groups and prefill instances."""
    router = Router(page_size=layout.page_size, prefill_page_size=layout.prefill_page_size,
                    policy=config.policy, policy_config=config.policy_config)
    for g in range(layout.dp):
        router.add_group(g, capacity_pages=layout.num_pages or None)
    for i in range(layout.prefill_instances):
        router.add_prefill_instance(i, capacity_pages=layout.prefill_num_pages or None)
    return router


@dataclass(slots=True)
class _Live:
    record: RequestRecord
    cached: int = 0  # most prompt tokens any side reported served from its prefix cache
    prefilled: bool = False


def _index_of(out: StepOutput, record: RequestRecord) -> int:
    index = getattr(out, "index", None)
    return index if isinstance(index, int) and index >= 0 else record.next_index


def _reported(out: StepOutput, at: int, fresh: list[tuple[int, int]]):
    """(logprobs of the `fresh` (index, token) pairs of `out`, whose first token has
    index `at`; the prompt logprobs when index 0 is among them), None where not asked."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = [out.logprobs[i - at] for i, _ in fresh]
    prompt = out.prompt_logprobs if fresh and fresh[0][0] == 0 else None
    return logprobs, prompt


def _load_of(stats: dict) -> GroupLoad:
    """A leader's engine stats as the router's load snapshot."""
    held = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
    kv = min(1.0, max(0.0, float(stats.get("kv_usage", 0.0))))
    return GroupLoad(int(stats.get("num_waiting_tokens", 0)), held, kv)


class ClusterDriver(OwnerThread):
    """One thread that owns a multi-rank client and a router (see the module docstring).

    `submit` queues a request (a refusal arrives through `sink.on_error`); `stop` aborts
    what is live, closes the client, ends the thread and waits for it. `close_client`
    (default `client.close`) runs on the thread when it ends."""

    def __init__(self, client: Any, sink: DriverSink, *, layout: Optional[ClusterLayout] = None,
                 router: Optional[Router] = None, config: DriverConfig = DriverConfig(),
                 close_client: Optional[Callable[[], None]] = None,
                 name: str = "phalanx-cluster") -> None:
        super().__init__(sink, name)
        self._client, self.config = client, config
        self.layout = layout or ClusterLayout.of(client)
        self.router = router or make_router(self.layout, config)
        self._close_client = close_client or client.close
        self._live: dict[str, _Live] = {}
        self.admission = Admission(self.router, config.admission)
        self._next_load = self._next_prefix = 0.0

    # -- the driver thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                self._loop()
            except BaseException as e:  # noqa: BLE001 - a dead cluster must tell its requests
                self._fail(e)
                self._refuse_until_stop(e)
        finally:
            try:
                self._close_client()
            except Exception as e:  # noqa: BLE001 - shutting down regardless
                log.warning("cluster_close_failed", error=repr(e))

    def _loop(self) -> None:
        self._refresh()
        while True:
            wait = max(0.0, min(self._next_load, self._next_prefix) - time.monotonic())
            if not self._drain(block=not self._live, timeout=wait):
                self._abort_all()
                return
            if self._live:
                self._forward(self._client.poll())
            self._refresh()
            self._admit()

    def _apply_submit(self, rid: str, tokens: list[int], params: SamplingParams) -> None:
        if rid in self._live or rid in self.admission:
            self._sink.on_error(rid, ValueError(f"request_id {rid!r} is already in use"))
            return
        try:
            record = RequestRecord(rid, tokens, params)
        except ValueError as e:
            self._sink.on_error(rid, e)
            return
        self.router.prepare(record)  # the prompt's pages hashed once, kept on the record
        self.admission.hold(record)
        self._admit()

    def _admit(self) -> None:
        """Sends every request admission places now (all of them when it holds none)."""
        for record, group in self.admission.place():
            self._start(record, group)

    def _start(self, record: RequestRecord, group: int) -> None:
        rid = record.request_id
        instance = self.router.route_prefill(record) if self.layout.prefill_instances else -1
        try:
            self._client.submit(rid, list(record.prompt_token_ids), record.sampling_params,
                                Placement(group, instance))
        except ValueError as e:
            self.router.finish(rid)
            self._sink.on_error(rid, _cause(e))
            return
        self._live[rid] = _Live(record)
        log.debug("request_routed", request_id=rid, dp_group=group, prefill_instance=instance)

    def _apply_abort(self, rid: str) -> None:
        held = self.admission.drop(rid)
        if held is not None:
            held.abort()
            return
        live = self._live.pop(rid, None)
        if live is None:
            return
        self._client.abort(rid)
        live.record.abort()
        self._end(rid, live.record)

    def _end(self, rid: str, record: RequestRecord) -> None:
        self.router.finish(record)

    def _forward(self, outputs: list[StepOutput]) -> None:
        deltas: list[tuple[str, TokenDelta]] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # aborted, failed or already finished: nothing more reaches anyone
            delta = self._accept(live, out)
            if delta is not None:
                deltas.append((out.request_id, delta))
        if deltas:
            self._sink.on_deltas(deltas)

    def _accept(self, live: _Live, out: StepOutput) -> Optional[TokenDelta]:
        """The delta `out` adds to its request (None: nothing new); ends the request when
        it finished, or when its output is inconsistent (a gap: the request fails)."""
        rec, rid = live.record, out.request_id
        at = _index_of(out, rec)
        try:
            fresh = rec.accept(at, out.new_token_ids, out.finished, out.finish_reason)
        except (ValueError, RuntimeError) as e:  # TokenGapError, RequestStateError, ...
            log.error("request_output_inconsistent", request_id=rid, error=str(e))
            del self._live[rid]
            self._client.abort(rid)
            rec.fail(str(e))
            self._end(rid, rec)
            self._sink.on_error(rid, RuntimeError(f"inconsistent output: {e}"))
            return None
        live.cached = max(live.cached, out.num_cached_tokens)
        if rec.next_index and not live.prefilled:
            live.prefilled = True
            self.router.prefill_done(rec)
        if not fresh and not rec.done:
            return None  # a duplicate: the client already has these indexes
        start = fresh[0][0] if fresh else rec.next_index
        tokens = [t for _, t in fresh]
        logprobs, prompt = _reported(out, at, fresh)
        first = bool(fresh) and fresh[0][0] == 0
        timings = (out.queued_s, out.prefill_s) if first else (-1.0, -1.0)
        if not rec.done:
            return TokenDelta(start, tokens, logprobs=logprobs, prompt_logprobs=prompt,
                              queued_s=timings[0], prefill_s=timings[1])
        del self._live[rid]
        self._end(rid, rec)
        return TokenDelta(start, tokens, True, rec.finish_reason or "stop", live.cached,
                          logprobs, prompt, *timings)

    def _abort_all(self) -> None:
        for record in self.admission.drop_all():
            record.abort()
        for rid in list(self._live):
            try:
                self._apply_abort(rid)
            except Exception as e:  # noqa: BLE001 - stopping anyway; the client closes next
                log.warning("abort_on_stop_failed", request_id=rid, error=repr(e))

    # -- load and prefixes -----------------------------------------------------------
    def _refresh(self) -> None:
        now = time.monotonic()
        if now >= self._next_load:
            self._next_load = now + self.config.load_interval_s
            self._refresh_load()
        if now >= self._next_prefix:
            self._next_prefix = now + self.config.prefix_interval_s
            self._refresh_prefixes()

    def _refresh_load(self) -> None:
        maintain = getattr(self._client, "maintain", None)
        if maintain is not None and not self._live:
            maintain()  # idle: deaths and widening are not waiting for the next poll
        try:
            view = self._client.leader_stats()
        except TimeoutError as e:  # a slow answer is not a failure; try again next time
            log.warning("leader_stats_timeout", error=str(e))
            return
        r = self.router
        for g, s in enumerate(view.get("decode", ())):
            if g in r.decode and s:
                r.update_load(g, _load_of(s))
        for i, s in enumerate(view.get("prefill", ())):
            if i in r.prefill and s:
                r.update_prefill_load(i, _load_of(s))
        self.stats = summarize(view, r, live=len(self._live), held=len(self.admission))

    def _refresh_prefixes(self) -> None:
        r = self.router
        as_of, as_of_prefill = r.prefix_clock, r.prefill.tree.clock
        try:
            held = self._client.held_prefixes()
        except TimeoutError as e:
            log.warning("held_prefixes_timeout", error=str(e))
            return
        # A list is every hash a leader holds; {"evicted": [...]} what it dropped since
        # its last report (actors/held_reports.py).
        for g, report in enumerate(held.get("decode", ())):
            if g in r.decode:
                if isinstance(report, dict):
                    r.forget_prefixes(g, report.get("evicted", ()), as_of)
                else:
                    r.refresh_prefixes(g, report, as_of)
        for i, report in enumerate(held.get("prefill", ())):
            if i in r.prefill:
                if isinstance(report, dict):
                    r.forget_prefill_prefixes(i, report.get("evicted", ()), as_of_prefill)
                else:
                    r.refresh_prefill_prefixes(i, report, as_of_prefill)

    # -- failure ---------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        self.failure = error
        log.error("cluster_failed", error=repr(error), live=len(self._live))
        for live in self._live.values():
            live.record.fail(str(error))
        self._live.clear()
        for record in self.admission.drop_all():
            record.fail(str(error))
        self.stats = {**self.stats, "healthy": 0.0}
        self._sink.on_failure(error)

    def _refuse_until_stop(self, error: BaseException) -> None:
        """After a failure: answer every queued submit with the error until `stop`."""
        while True:
            cmd = self._inbox.get()
            if cmd is STOP:
                return
            if cmd[0] == "submit":
                self._sink.on_error(cmd[1], RuntimeError(f"cluster failed: {error}"))


def _cause(e: ValueError) -> ValueError:
    """The original ValueError of one raised in a Ray actor (`RayTaskError` carries the
    remote traceback in its message; its `cause` is the exception itself)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, ValueError) else e
