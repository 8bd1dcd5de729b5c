"""Wire format of the KV transport: msgspec control messages, copy tables and templates.

Every control message is a tagged msgspec Struct encoded with msgpack (never pickle) and
framed as one transport message: a little-endian u64 length, then the body (`frame`), so
the receiver can keep receives posted into fixed buffers (`MAX_CTRL_BYTES`). On one
connection (a prefill rank -> a decode rank) the sender speaks first with `Hello` and the
receiver answers `HelloAck` (with the payload capacity of its receive buffers); then each
message is a `TransferRequest` plus its payload, answered by one `TransferAck` with the
same `seq`: either one message of exactly `payload_bytes` raw bytes into a staging
buffer, or (`direct`) one message per block on the message's own tag, received straight
into the pool span the block names (`spans`). A direct message may be *announced*: its
`TransferRequest` goes ahead (when the sender prepares it, before its pages are
computed), so the receiver's receives wait posted, and a `Posted` follows once the
payload is on its way, or a `Withdrawn` if it never will be (the withdrawn payload
arrives as empty messages that complete those receives; it is not acknowledged). A
template may also go ahead of its staged messages (`DefineTemplate`). Every
message carries the epoch of the group that produced it; a receiver drops (never
applies) messages of another epoch.

Copy descriptors are little-endian int32 tables `[n, 10]` (`COPY_FIELDS`), a compact
form of `planner.Copy` without the two ranks (implicit in the connection). A request's
copies repeat one pattern per (layer, kind), so they travel as a *template* (a copy
table whose layer and kind columns are unused, sent once per connection) and *blocks*
`[n, 4]` (`BLOCK_FIELDS`: rows [row_start, row_stop) of the template applied to pool
(layer, kind)): a message costs O(blocks) host work, not O(copies) (`templates_of`;
a `CopyBatch` is a template with its blocks).
The payload is the concatenation, block by block and row by row, of each copy's slab
`[num_heads, num_tokens, head_dim]` (row-major) of the source pool. `copy_rows` maps a
table to pool rows: a pool `[num_pages, heads, page_size, head_dim]` viewed as
`[-1, g * head_dim]` (runs of g tokens of one head; g divides the page size, the offsets
and the run lengths), each side choosing its own g per run of rows (`segments`).

Pure logic: numpy and msgspec only; no torch, no I/O.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple, Optional, Union

import msgspec
import numpy as np

from .planner import Copy

PROTOCOL_VERSION = 6
MAX_CTRL_BYTES = 1 << 20   # a framed TransferRequest (header + copy table) fits in this
MAX_REPLY_BYTES = 1 << 16  # a framed Hello, HelloAck or TransferAck fits in this
KIND_CODES = {"k": 0, "v": 1}
COPY_FIELDS = ("layer", "kind", "src_head", "dst_head", "num_heads", "src_page",
               "src_offset", "dst_page", "dst_offset", "num_tokens")
(F_LAYER, F_KIND, F_SRC_HEAD, F_DST_HEAD, F_NUM_HEADS, F_SRC_PAGE, F_SRC_OFFSET,
 F_DST_PAGE, F_DST_OFFSET, F_NUM_TOKENS) = range(len(COPY_FIELDS))
# (head, page, offset) columns of each side
SIDE_COLUMNS = {"src": (F_SRC_HEAD, F_SRC_PAGE, F_SRC_OFFSET),
                "dst": (F_DST_HEAD, F_DST_PAGE, F_DST_OFFSET)}
_COPY_DTYPE = np.dtype("<i4")
BLOCK_FIELDS = ("layer", "kind", "row_start", "row_stop")
MAX_TEMPLATE_ROWS = 16384  # a template table (640 KiB) fits a control message
MAX_BLOCKS = 4096          # blocks per message (64 KiB)


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Sender -> receiver, first message of a connection."""

    version: int
    epoch: int
    sender_rank: int
    dtype: str        # torch dtype name of the pools, e.g. "float16"
    head_dim: int


class HelloAck(msgspec.Struct, tag="hello_ack", frozen=True):
    """Receiver -> sender: accepted (ok) or rejected with `error`, then closed.
    `max_payload_bytes`: the largest payload of a staged TransferRequest, and the
    largest block of a direct one (direct messages may carry any number of blocks up to
    `MAX_BLOCKS`).
    `pool_shape`: the receiver's (num_pages, heads, page_size, head_dim) when it takes
    payloads in place (`TransferRequest.direct`); () when it does not."""

    epoch: int
    receiver_rank: int
    ok: bool
    max_payload_bytes: int = 0
    error: str = ""
    pool_shape: tuple[int, ...] = ()


class TransferRequest(msgspec.Struct, tag="xfer", frozen=True):
    """A batch of blocks for one destination, followed by `payload_bytes` raw bytes.

    `seq` numbers the requests of one connection (from 1); [layer_start, layer_stop)
    spans the blocks' layers. `template` names a template of this connection; its table
    travels in `template_table` (`packed_table.pack_table`) with the first message that
    uses it (b"" afterwards).
    `blocks` is the int32 block table (`encode_blocks`).

    direct: every block is one span of the receiver's pools (`spans.SlabSpans`) and its
    payload follows as its own transport message (`ucx_runtime.direct_tag(seq)`), block
    by block, received in place; `block_bytes` (little-endian int64 per block) declares
    their sizes, so a receiver that refuses the message can still take it off the wire,
    and `dst_starts` (little-endian int64 per block) where each span starts, in elements
    of its (layer, kind) pool. A direct message names no template (`template` -1, no table):
    the receiver writes it from the blocks' layer and kind, starts and sizes alone, so
    its receives are posted without locating any template (their rows are the
    sender's). Otherwise the payload is one message (TAG_PAYLOAD) into a staging buffer.

    announce_ms > 0 (direct only): announced ahead of its payload; the sender sends its
    `Posted` or `Withdrawn` within this many milliseconds of sending this."""

    request_id: str
    epoch: int
    seq: int
    layer_start: int
    layer_stop: int
    template: int
    template_table: bytes
    blocks: bytes
    payload_bytes: int
    direct: bool = False
    block_bytes: bytes = b""
    dst_starts: bytes = b""
    announce_ms: int = 0


class DefineTemplate(msgspec.Struct, tag="template", frozen=True):
    """Sender -> receiver: template `template` of `request_id` (`packed_table.pack_table`
    of its table), sent ahead of the staged messages that name it (at `prepare`), so the
    receiver locates it while the pages are computed."""

    request_id: str
    epoch: int
    template: int
    table: bytes


class Posted(msgspec.Struct, tag="posted", frozen=True):
    """Sender -> receiver: announced message `seq`'s payload is posted (its receives'
    deadline runs from here)."""

    request_id: str
    epoch: int
    seq: int


class Withdrawn(msgspec.Struct, tag="withdrawn", frozen=True):
    """Sender -> receiver: announced message `seq` is never sent; one empty message per
    block follows on its tag (completing the posted receives; nothing is written)."""

    request_id: str
    epoch: int
    seq: int


class TransferAck(msgspec.Struct, tag="ack", frozen=True):
    """Receiver -> sender: the batch `seq` of `request_id` landed (ok) or was dropped."""

    request_id: str
    epoch: int
    seq: int
    layer_start: int
    layer_stop: int
    ok: bool
    error: str = ""


ToReceiver = Union[Hello, TransferRequest, DefineTemplate, Posted, Withdrawn]
ToSender = Union[HelloAck, TransferAck]

_ENCODER = msgspec.msgpack.Encoder()
TO_RECEIVER = msgspec.msgpack.Decoder(ToReceiver)
TO_SENDER = msgspec.msgpack.Decoder(ToSender)


_LEN = np.dtype("<u8")


def frame(msg: msgspec.Struct) -> bytes:
    """u64 length + msgpack body: one transport message."""
    body = _ENCODER.encode(msg)
    return np.array([len(body)], dtype=_LEN).tobytes() + body


def unframe(buf: bytearray, decoder: msgspec.msgpack.Decoder) -> msgspec.Struct:
    """Decode a framed message from the start of `buf`; ValueError if malformed."""
    size = int(np.frombuffer(buf, dtype=_LEN, count=1)[0])
    if not 0 < size <= len(buf) - _LEN.itemsize:
        raise ValueError(f"framed message of {size} bytes in a {len(buf)}-byte buffer")
    try:
        return decoder.decode(memoryview(buf)[_LEN.itemsize:_LEN.itemsize + size])
    except msgspec.DecodeError as e:
        raise ValueError(f"undecodable control message: {e}") from e


_COPY_GETTER = operator.attrgetter(*COPY_FIELDS)


def encode_copies(copies: Sequence[Copy]) -> np.ndarray:
    """The int32 table `[n, 10]` of `copies` (columns `COPY_FIELDS`, kind as 0/1)."""
    rows = [_COPY_GETTER(c) for c in copies]
    if not rows:
        return np.empty((0, len(COPY_FIELDS)), dtype=_COPY_DTYPE)
    kinds = np.array([KIND_CODES[r[1]] for r in rows], dtype=_COPY_DTYPE)
    table = np.array([r[:1] + (0,) + r[2:] for r in rows], dtype=_COPY_DTYPE)
    table[:, F_KIND] = kinds
    return table


def copy_nbytes(table: np.ndarray, head_dim: int, itemsize: int) -> np.ndarray:
    """Payload bytes of each copy of `table` (int64)."""
    return table[:, F_NUM_HEADS].astype(np.int64) * table[:, F_NUM_TOKENS] * head_dim * itemsize


def payload_nbytes(table: np.ndarray, head_dim: int, itemsize: int) -> int:
    """Bytes of the payload that carries `table`."""
    return int(copy_nbytes(table, head_dim, itemsize).sum())


def encode_blocks(blocks: np.ndarray) -> bytes:
    return np.ascontiguousarray(blocks, dtype=_COPY_DTYPE).tobytes()


def direct_sizes(msg: "TransferRequest", max_bytes: int) -> list[int]:
    """A direct message's payload message sizes (`block_bytes`); ValueError if they do
    not describe its payload in messages of at most `max_bytes` each."""
    raw = msg.block_bytes
    sizes = np.frombuffer(raw, dtype="<i8").tolist() if len(raw) % 8 == 0 else []
    if not sizes or min(sizes) <= 0 or sum(sizes) != msg.payload_bytes or max(sizes) > max_bytes:
        raise ValueError(f"direct message {msg.seq}: block sizes {sizes[:8]} do not describe "
                         f"a payload of {msg.payload_bytes} bytes in blocks of at most "
                         f"{max_bytes}")
    return sizes


def decode_blocks(raw: bytes) -> np.ndarray:
    """The int32 block table `[n, 4]` of a `TransferRequest.blocks`; ValueError if malformed."""
    width = len(BLOCK_FIELDS) * _COPY_DTYPE.itemsize
    if not raw or len(raw) % width:
        raise ValueError(f"block table of {len(raw)} bytes is not a positive multiple of {width}")
    return np.frombuffer(raw, dtype=_COPY_DTYPE).reshape(-1, len(BLOCK_FIELDS))


class CopyBatch(NamedTuple):
    """Copies as a template and the blocks that apply it, the unit a sender sends
    (`templates_of` cuts a copy table into these; `copy_table.plan_batches` builds them
    without the table)."""

    template: np.ndarray  # int32 [rows, len(COPY_FIELDS)]; layer and kind columns unused
    blocks: np.ndarray    # int32 [n, len(BLOCK_FIELDS)]


def templates_of(table: np.ndarray) -> list[CopyBatch]:
    """Cut a copy table into [(template, blocks)]: each maximal run of one (layer, kind)
    becomes a block of a template equal to the run with layer = kind = 0; runs with equal
    templates share one (a plan's layers all do). Templates longer than
    `MAX_TEMPLATE_ROWS` are cut. Replaying the blocks in order gives back `table`."""
    if len(table) == 0:
        return []
    key = table[:, F_LAYER].astype(np.int64) * 2 + table[:, F_KIND]
    cuts = np.flatnonzero(np.diff(key)) + 1
    starts, stops = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(table)]))
    same = _one_template(table, starts, stops)
    if same is not None:
        return [same]
    found: dict[bytes, tuple[np.ndarray, list]] = {}
    for a, b in zip(starts, stops):
        layer, kind = int(table[a, F_LAYER]), int(table[a, F_KIND])
        for c in range(int(a), int(b), MAX_TEMPLATE_ROWS):
            run = np.array(table[c:min(c + MAX_TEMPLATE_ROWS, int(b))], dtype=_COPY_DTYPE)
            run[:, (F_LAYER, F_KIND)] = 0
            entry = found.setdefault(run.tobytes(), (run, []))
            entry[1].append((layer, kind, 0, len(run)))
    return [CopyBatch(run, np.array(blocks, dtype=_COPY_DTYPE)) for run, blocks in found.values()]


def _one_template(table: np.ndarray, starts: np.ndarray, stops: np.ndarray
                  ) -> Optional[CopyBatch]:
    """The batch when every (layer, kind) run is the same rows (a plan's usual shape:
    one vectorised comparison instead of hashing run by run), else None."""
    rows = int(stops[0] - starts[0])
    if rows > MAX_TEMPLATE_ROWS or not (stops - starts == rows).all():
        return None
    runs = np.asarray(table, dtype=_COPY_DTYPE).reshape(len(starts), rows, -1)
    # layer and kind are columns 0 and 1: the rest is one slice
    if not (runs[1:, :, 2:] == runs[:1, :, 2:]).all():
        return None
    template = runs[0].copy()
    template[:, (F_LAYER, F_KIND)] = 0
    blocks = np.zeros((len(starts), 4), dtype=_COPY_DTYPE)
    blocks[:, 0], blocks[:, 1], blocks[:, 3] = runs[:, 0, F_LAYER], runs[:, 0, F_KIND], rows
    return CopyBatch(template, blocks)


def check_blocks(blocks: np.ndarray, num_layers: int, rows: int) -> str:
    """'' if every block names a layer, a kind and a non-empty row range of a template of
    `rows` rows, else what is wrong."""
    layer, kind, r0, r1 = (blocks[:, i] for i in range(4))
    bad = (layer < 0) | (layer >= num_layers) | (kind < 0) | (kind > 1) | (r0 < 0) \
        | (r1 <= r0) | (r1 > rows)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return f"block {i} {dict(zip(BLOCK_FIELDS, blocks[i].tolist()))}: out of range"
    return ""


def check_copies(table: np.ndarray, side: str, num_layers: int, num_pages: int,
                 heads: int, page_size: int) -> str:
    """'' if every copy of `table` fits `side`'s pools, else what is wrong (vectorized)."""
    if table.size == 0:
        return "empty copy table"
    head, page, off = (table[:, c] for c in SIDE_COLUMNS[side])
    nh, nt = table[:, F_NUM_HEADS], table[:, F_NUM_TOKENS]
    checks = (
        ("layer", (table[:, F_LAYER] < 0) | (table[:, F_LAYER] >= num_layers)),
        ("kind", (table[:, F_KIND] < 0) | (table[:, F_KIND] > 1)),
        ("num_heads/num_tokens", (nh <= 0) | (nt <= 0)),
        (f"{side} head range", (head < 0) | (head.astype(np.int64) + nh > heads)),
        (f"{side} page", (page < 0) | (page >= num_pages)),
        (f"{side} token range", (off < 0) | (off.astype(np.int64) + nt > page_size)),
    )
    for name, bad in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return f"copy {i} {dict(zip(COPY_FIELDS, table[i].tolist()))}: bad {name}"
    return ""


def granules(table: np.ndarray, side: str, page_size: int) -> np.ndarray:
    """Per copy, the largest run g of tokens such that its slots on `side` split into
    whole rows of g tokens: gcd(offset, num_tokens, page_size)."""
    off = table[:, SIDE_COLUMNS[side][2]].astype(np.int64)
    return np.gcd(np.gcd(off, table[:, F_NUM_TOKENS].astype(np.int64)), page_size)


def segments(table: np.ndarray, side: str, page_size: int) -> list[tuple[int, int, int, int, int]]:
    """Maximal runs of copies with one (layer, kind, granule):
    [(layer, kind, granule, first, stop)]; each run is one gather or scatter op."""
    if len(table) == 0:
        return []
    g = granules(table, side, page_size)
    key = (table[:, F_LAYER].astype(np.int64) * 2 + table[:, F_KIND]) * (page_size + 1) + g
    cuts = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [len(table)]))
    return [(int(table[a, F_LAYER]), int(table[a, F_KIND]), int(g[a]), int(a), int(b))
            for a, b in zip(starts, stops)]


def copy_rows(table: np.ndarray, side: str, heads: int, page_size: int,
              granule: int = 1) -> np.ndarray:
    """int64 rows of `side`'s pool viewed as `[-1, granule * head_dim]` (runs of
    `granule` tokens of one head) holding the slots of `table`, in payload order: copy by
    copy, head-major, then token. Every offset and num_tokens must divide by `granule`."""
    head_c, page_c, off_c = SIDE_COLUMNS[side]
    t = table.astype(np.int64)
    nh, nt = t[:, F_NUM_HEADS], t[:, F_NUM_TOKENS] // granule
    counts = nh * nt
    cid = np.repeat(np.arange(len(t)), counts)
    local = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                      counts)
    ntc = nt[cid]
    j, tok = local // ntc, local % ntc
    per_page = page_size // granule
    return ((t[cid, page_c] * heads + t[cid, head_c] + j) * per_page
            + t[cid, off_c] // granule + tok)
