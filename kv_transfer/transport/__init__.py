"""Transport: UCX (ucxx) moving KV pages: `KVSender` (one per prefill rank process) streams
batches of copies (`planner.Copy` lists, copy tables, or `messages.CopyBatch` templates
with their blocks) to `KVReceiver`s (one per decode rank process), raw bytes, no
pickle. Wire format: `messages`.

A batch (one destination; one layer, or a chunk of layers) is queued on the connection
to its peer. The sender's pump cuts or coalesces queued batches of one request into
messages of at most the receiver's capacity (direct messages sent from the sender's
pools have no such bound: they need no buffer on either side), gathers each message's
source slabs into one contiguous staging buffer (an index_select per (layer, kind) run),
and posts the `TransferRequest` then the payload. `prepare` does the locating and
cutting of a batch ahead, e.g. while the engine computes the layers it reads, and
*announces* its parts that go from pool to pool: their `TransferRequest`s leave at
once, so the receiver's receives are posted before the pages are computed, and
`send_layer` later posts a `Posted` and the payload (each direct message has its own
payload tag, so announced messages may be sent in any order). An announced message
not sent within its wait (or evicted, or `withdraw`n, or of an older epoch) is
withdrawn: a `Withdrawn` and empty messages complete the posted receives, nothing is
written, nothing is acked. The receiver keeps `staging_buffers` receives of
both posted ahead (so data flows while it scatters the previous message), scatters the
payload into its pools, then acks. Blocks that are large spans of the receiver's pools
(`spans`: whole consecutive pages holding the same heads on both sides) skip the
staging: the message is `direct`, each block travels as its own transport message
(from the sender's pools when it is a span there too) and the receiver, having read and
checked the control message (which says where each block lands: no template to locate),
receives it straight into the pool region. `send_layer` returns once its batch is acked,
i.e. written; batches to one peer land in call order, except announced messages, each of
which lands when its payload does.

Deadlines (ARCHITECTURE §5): every wait runs under `asyncio.wait_for`: `send_layer` until
its ack, the receiver's handshake and a payload once its control message is read (an
announced one's from its `Posted`, which must come within the wait the announcement
names plus the receiver's timeout), `wait_request` until its KV landed. A timeout, a
rejected batch or a lost peer raises `TransferError(request_id, epoch, peer)`. A connection that saw a timeout or an error is *broken*: it is aborted
(the peer sees the close), all its pending batches fail at once, and `connect` must be
called again. A dead peer never hangs the other side: its pending operations fail when
UCX reports the closed endpoint, or at the deadline at the latest. Fencing: each message
carries the sender's epoch; the receiver applies only its own epoch's batches and answers
the others with a negative ack (their data is dropped).

Threading model: ucxx keeps one context per process, and its Python futures are bound to
the event loop that first initialised it (`ensure_ucx`). So every sender and receiver of
a process runs on one asyncio loop: either the caller's own loop (call the async API
from it), or a `TransportThread` (a daemon thread running that loop) driven from
synchronous code through `BlockingKVSender` / `BlockingKVReceiver`. Objects here are not
thread-safe: touch them only on their loop. Pool tensors are read (sender) or written
(receiver) on the loop thread; the engine must not write a page while it is being sent
nor read a page before its request is reported landed.

Parts: `protocols` (what the roles need: `KVSenderProtocol`, `KVReceiverProtocol`),
`blocking` (their implementations for synchronous callers), `sender` / `send_connection` /
`part_cutter`, `receiver` / `receive_connection` / `direct_landing`, `staging` /
`staging_memory` / `slab_copy` (host or device staging), `ucx_runtime` (ucxx process
state, posting, `TransportThread`), `errors`. Uses `planning` (what to copy); never the
other way round. This package re-exports the public names the rest of phalanx uses.
"""

from __future__ import annotations

from .blocking import BlockingKVReceiver, BlockingKVSender
from .errors import TransferError
from .part_cutter import Copies
from .protocols import KVReceiverProtocol, KVSenderProtocol
from .receiver import KVReceiver
from .sender import KVSender
from .staging import KVPools
from .ucx_runtime import (TAG_CTRL, TAG_PAYLOAD, TAG_REPLY, Address, TransportThread,
                          ensure_ucx, progress_mode_for, shutdown_ucx)

__all__ = ["Address", "BlockingKVReceiver", "BlockingKVSender", "Copies", "KVPools",
           "KVReceiver", "KVReceiverProtocol", "KVSender", "KVSenderProtocol", "TAG_CTRL",
           "TAG_PAYLOAD", "TAG_REPLY", "TransferError", "TransportThread", "ensure_ucx",
           "progress_mode_for", "shutdown_ucx"]
