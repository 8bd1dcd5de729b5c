"""`PrefillRole`: a rank of a prefill TP group streams each request's KV to its decode
ranks layer by layer, while it computes the later layers (ARCHITECTURE §2, §4).

Every rank of the group learns each request's destination up front (`expect`, before
the leader schedules it) and recognises the request's rows in every step by their plan
row key. After layer i of a step, each rank sends the copies it is the holder of (the
resharding planner decides) for the tokens computed so far and not yet sent. When a
request's last prompt token has been sent and every batch is acked, the rank reports the
transfer done; the leader keeps the request's pages (`hold_kv`) until the caller, having
heard from every rank, says `release`.
"""

from __future__ import annotations

import concurrent.futures
from collections import defaultdict
from dataclasses import dataclass, field

from ...kv_transfer.planning.copy_table import layer_batches, plan_batches
from ...kv_transfer.planning.layout import KVLayout
from ...kv_transfer.transport import Address, BlockingKVSender, KVSenderProtocol
from ...log import get_logger
from .kv_side import TRANSFER_EPOCH, KVSide
from .role import RankRole

__all__ = ["KVDestination", "PrefillRole", "TransferEvent"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class KVDestination:
    """Where one request's prompt KV goes: one decode DP rank (all its TP ranks)."""

    request_id: str
    transfer_id: str  # request id + attempt: the receivers' gate key
    addresses: tuple[Address, ...]  # receiver of each decode TP rank, by TP rank
    layout: KVLayout  # the decode side's layout (its TP degree and page size)
    pages: tuple[int, ...]  # decode pages reserved for the prompt
    num_tokens: int  # prompt length
    replica_hint: int  # spreads reads over prefill replicas of a head (decode DP rank)
    start: int = 0  # tokens [0, start) are in the decode pages already (its prefix cache)


@dataclass(slots=True)
class TransferEvent:
    """A rank's report on one transfer: done (every batch acked) or failed."""

    request_id: str
    transfer_id: str
    rank: int
    ok: bool
    error: str = ""


@dataclass(slots=True)
class _Stream:
    dest: KVDestination
    sent_upto: int = 0  # tokens [0, sent_upto) are queued for sending
    futures: list = field(default_factory=list)
    failed: str = ""


class PrefillRole(RankRole):
    """Every rank streams the KV it holds; the leader prefills and holds the pages.

    Caller side: `expect`, `submit_prefill`, `forget`, `release` (the actor's methods);
    transfer events reach callers through the rank's `poll_events`."""

    name = "prefill"

    def __init__(self) -> None:
        self._rank = None
        self._streams: dict[int, _Stream] = {}  # plan row key -> stream (under the mailbox lock)
        self._step_keys: list[tuple[int, int]] = []  # (key, end) streamed by this step
        self._sender: KVSenderProtocol = None
        self._kv: KVSide = None

    def start(self, rank) -> dict:
        s = rank.spec
        self._rank, self._lock = rank, rank.mailbox.lock
        self._kv = KVSide.open(rank.engine, s.tp, s.rank)
        self._sender = BlockingKVSender(
            self._kv.transport, rank.engine.runner.caches, rank=s.tp_rank, epoch=TRANSFER_EPOCH,
            timeout_s=s.deadline_s, in_place_min_bytes=s.config.cache.kv_in_place_min_bytes)
        return {}

    # -- caller side -----------------------------------------------------------------
    def expect(self, key: int, dest: KVDestination) -> None:
        """Learn a request's destination (every rank, before the leader's submit)."""
        for address in dest.addresses:
            self._sender.connect(tuple(address))
        with self._lock:
            self._rank.mailbox.raise_if_failed()
            self._streams[key] = _Stream(dest, sent_upto=dest.start)

    def submit_prefill(self, request_id: str, prompt_token_ids: list[int], params, key: int) -> None:
        """Prefill only (the leader): sample the first token, hold the pages for `release`."""
        self._rank.enqueue("prefill", request_id, prompt_token_ids, params, key)

    def forget(self, key: int) -> None:
        """Stop streaming `key` (its request was aborted or moved elsewhere); what this
        step announced for it is withdrawn."""
        with self._lock:
            stream = self._streams.pop(key, None)
        if stream is not None:
            self._sender.withdraw(stream.dest.transfer_id)

    def release(self, request_id: str) -> None:
        """Every reader is done: the leader frees the request's pages."""
        self._rank.mailbox.post("release", request_id)

    # -- loop side -------------------------------------------------------------------
    def handle(self, kind: str, item) -> bool:
        if kind == "prefill":
            self._rank.engine.add_prefill_request(*item)
        elif kind == "release":
            self._rank.engine.release_held(item)
        else:
            return False
        return True

    def layer_hook(self, inputs):
        sends = self._plan_sends(inputs)
        if not sends:
            return None

        def layer_done(layer: int) -> None:
            for key, dst_rank, copies in sends.get(layer, ()):
                dropped = self._rank.fault_point("kv_send")
                stream = self._streams.get(key)
                if stream is None:  # forgotten during the step (its batches withdrawn)
                    continue
                if dropped:  # the batch is lost on the link: the transfer fails
                    stream.failed = "a KV batch was dropped (fault point kv_send)"
                    continue
                address = tuple(stream.dest.addresses[dst_rank])
                stream.futures.append(self._sender.submit_layer(
                    address, stream.dest.transfer_id, copies))

        return layer_done

    def _plan_sends(self, inputs) -> dict[int, list]:
        """This rank's copies of this step, by layer: [(key, decode tp rank, copies)]."""
        h = inputs.host
        self._step_keys = []
        sends: dict[int, list] = defaultdict(list)
        with self._lock:
            streams = dict(self._streams)
        layout, tp_rank = self._kv.layout, self._rank.spec.tp_rank
        for row, key in enumerate(h["row_keys"].tolist()):
            stream = streams.get(key)
            if not key or stream is None or stream.failed:
                continue
            dest = stream.dest
            end = min(int(h["seq_lens"][row]), dest.num_tokens)
            if end <= stream.sent_upto:
                continue
            src_pages = h["block_tables"][row, :-(-end // layout.page_size)].tolist()
            batches = plan_batches(layout, dest.layout, range(stream.sent_upto, end),
                                   src_pages, dest.pages, replica_hint=dest.replica_hint)
            for (src_rank, dst_rank), pair in batches.items():
                if src_rank == tp_rank:
                    for layer, parts in layer_batches(pair).items():
                        sends[layer].append((key, dst_rank, parts))
            self._step_keys.append((key, end))
        if sends:  # located on the transport loop while the step computes
            self._sender.prepare([(tuple(streams[key].dest.addresses[dst_rank]),
                                   streams[key].dest.transfer_id, copies)
                                  for layer_sends in sends.values()
                                  for key, dst_rank, copies in layer_sends])
        return sends

    def after_forward(self, inputs) -> None:
        with self._lock:
            for key, end in self._step_keys:
                stream = self._streams.get(key)  # None: forgotten during the step
                if stream is not None:
                    stream.sent_upto = end
        self._step_keys = []

    def service(self) -> None:
        """Report streams whose last batch is acked, or that failed."""
        if not self._streams:
            return
        events, spec = [], self._rank.spec
        with self._lock:
            for key, st in list(self._streams.items()):
                error = st.failed or _first_error(st.futures)
                complete = st.sent_upto >= st.dest.num_tokens
                if not error and not (complete and all(f.done() for f in st.futures)):
                    continue
                del self._streams[key]
                events.append(TransferEvent(st.dest.request_id, st.dest.transfer_id,
                                            spec.rank, not error, error))
        self._rank.mailbox.publish_events(events)
        for e in events:
            if not e.ok:
                log.warning("kv_transfer_failed", rank=spec.rank, epoch=spec.epoch,
                            request_id=e.request_id, transfer_id=e.transfer_id, error=e.error)


def _first_error(futures: list[concurrent.futures.Future]) -> str:
    for f in futures:
        if f.done() and f.exception() is not None:
            return f"{type(f.exception()).__name__}: {f.exception()}"
    return ""
