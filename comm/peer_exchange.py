"""An all-to-all of equal blocks through symmetric memory, waited for on the device.

``exchange(send)`` has ``all_to_all_single``'s result for equal splits: with ``cap``
rows per block, rank d's ``recv[s * cap:(s + 1) * cap]`` is rank s's
``send[d * cap:(d + 1) * cap]``. The sends are stores into the peers' buffers and the
waits spin on flags in device code (comm/gpu/exchange.py), so a step of exchanges is
queued without the host waiting per collective, and can be captured in a CUDA graph.

Failure (ARCHITECTURE §5): a wait ends when every block is flagged, when the host sets
the abort word, or after ``max_spins``; a wait that ended otherwise than flagged marks
``status`` (sticky), and everything computed from that step is garbage. With
``deadline_s``, every wait (re)arms a watchdog thread that raises the abort word
``deadline_s`` after the last wait was queued if that wait has not finished by then (a
CUDA event recorded behind it; on CPU the interpreter runs the wait itself, so it is
over when the call returns), so a host blocked anywhere (a sync behind a spinning wait,
or the interpreter spinning) is freed at the deadline, and a finished wait is never
aborted later, settled or not. :meth:`settle` ends a step: it waits for the
stream within the deadline (aborting past it) and raises :class:`CollectiveError` if
any wait failed. After a failure the exchange is finished: the group re-forms with new
buffers under a new epoch.

Reuse without acknowledgements: the ranks run the same exchanges in the same order on
one stream each, and two exchanges alternate (dispatch, combine). Rank s stores into
rank d's buffer for exchange n + 2 only after s waited for exchange n + 1, which d sent
only after its stream had finished reading exchange n's rows.
"""

from __future__ import annotations

import threading
import time

import torch

from .errors import CollectiveError
from .peer_backends import open_peer_memory
from .peer_memory import PeerMemory

__all__ = ["PeerExchange", "new_abort_word", "open_moe_channels"]

DEFAULT_MAX_SPINS = 2**31 - 1  # the abort word, not the spin bound, ends a wait on GPU


class PeerExchange:
    """One channel of equal-block all-to-alls over `peers`' world.

    max_rows: the most rows per block (``cap``) any exchange will use; width: the most
    elements per row; dtype: the rows' dtype. A channel's exchanges must be issued in
    the same order on every rank (each rank one stream).
    """

    def __init__(self, peers: PeerMemory, name: str, max_rows: int, width: int,
                 dtype: torch.dtype, epoch: int = 0, max_spins: int = DEFAULT_MAX_SPINS,
                 deadline_s: float | None = None,
                 abort_word: torch.Tensor | None = None, load_kernels: bool = True) -> None:
        """abort_word: an int32 [1] (pinned host memory on CUDA) shared with the rank's
        other channels, so that one channel's abort ends the waits of all of them (a
        step's dispatch and combine); default its own. load_kernels: on CUDA, compile and
        load the channel's kernels now (:meth:`_load_kernels`)."""
        from .gpu import exchange as k
        if max_rows < 1 or width < 1:
            raise ValueError(f"max_rows and width must be >= 1, got {max_rows}, {width}")
        if not 1 <= max_spins < 2**31:
            raise ValueError(f"max_spins must lie in [1, 2**31), got {max_spins}")
        self._k = k
        self.rank, self.world_size = peers.rank, peers.world_size
        self.epoch, self.max_rows, self.width, self.dtype = epoch, max_rows, width, dtype
        self.max_spins = max_spins
        self.max_chunks = -(-max_rows // k.ROWS)
        world = self.world_size
        self._peers = peers  # owns the peers' mappings that the pointers below address
        self.data = peers.alloc(f"{name}.data", world * max_rows * width, dtype)
        self.flags = peers.alloc(f"{name}.flags", world * self.max_chunks, torch.int64)
        self.device = self.data.device  # with its index: cuda:0, not cuda
        self._peer_data = peers.peer_ptrs(f"{name}.data")
        self._peer_flags = peers.peer_ptrs(f"{name}.flags")
        self._seq = torch.zeros(world, dtype=torch.int64, device=self.device)
        self.recv_counts = torch.zeros(world, dtype=torch.int64, device=self.device)
        self.status = torch.zeros(world, dtype=torch.int32, device=self.device)
        # the abort word lives in host memory so the host can raise it while kernels spin
        self._abort = abort_word if abort_word is not None else new_abort_word(self.device)
        self._cap: int | None = None
        self.exchanges = 0  # waits queued so far
        self._unsettled = False  # a wait queued since the last settle
        self.deadline_s = deadline_s
        self._watchdog = None if deadline_s is None else _Watchdog(self.abort, f"{name}-watchdog")
        self._queued = torch.cuda.Event() if self.device.type == "cuda" else None  # last wait
        if load_kernels and self.device.type == "cuda":
            self._load_kernels()

    def _load_kernels(self) -> None:
        """Run this channel's put (with and without counts) and wait kernels once in a
        world of one on its device, so its first exchange neither compiles (seconds,
        while a peer's wait spins toward its deadline) nor loads a module (a load can
        wait for the device to go idle: with two rank processes on one GPU, for the
        peer's spinning wait, which measured as every first wait missing its deadline)."""
        from .peer_memory import LocalWorld
        solo = PeerExchange(LocalWorld(1, self.device).rank(0), "load", 1, self.width,
                            self.dtype, load_kernels=False)
        rows = torch.zeros(1, self.width, dtype=self.dtype, device=self.device)
        solo.exchange(rows)
        solo.exchange(rows, torch.ones(1, dtype=torch.int64, device=self.device))
        torch.cuda.synchronize(self.device)

    def _outstanding(self) -> bool:
        """Whether the last queued wait may still be running (the watchdog's test)."""
        return self._queued is None or not self._queued.query()

    def exchange(self, send: torch.Tensor, counts: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """:meth:`put` then :meth:`wait`: the received rows [world * cap, W]."""
        self.put(send, counts)
        return self.wait()

    def put(self, send: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Queue the stores of `send` ([world * cap, W], W <= width, cap <= max_rows)
        into the peers. counts: int tensor [world] on the device, the rows of each block
        that matter (the rest is not sent and arrives undefined); None: all `cap`."""
        rows, W = send.shape
        world = self.world_size
        if rows % world or not 1 <= rows // world <= self.max_rows or W > self.width:
            raise ValueError(f"send {tuple(send.shape)}: need [world({world}) x cap <= "
                             f"{self.max_rows}, W <= {self.width}]")
        if send.dtype != self.dtype or send.device != self.device:
            raise ValueError(f"send is {send.dtype} on {send.device}, the channel "
                             f"{self.dtype} on {self.device}")
        if self._cap is not None:
            raise RuntimeError("put twice without a wait in between")
        if counts is not None and (counts.shape != (world,) or counts.device != self.device):
            raise ValueError(f"counts must be [{world}] on {self.device}, got "
                             f"{tuple(counts.shape)} on {counts.device}")
        self._cap = rows // world
        self._k.put(send.contiguous(), counts, self._peer_data, self._peer_flags, self._seq,
                    self.rank, self._cap, self.max_chunks)
        self._width = W

    def wait(self) -> torch.Tensor:
        """Queue the wait for every peer's block of the last :meth:`put`; returns the
        received rows [world * cap, W] and leaves each source's row count in
        ``recv_counts``. The rows are a view of the symmetric buffer: read them on this
        stream before this rank's next put on another channel, after which a peer may
        store its next blocks over them (the module docstring's alternation); a lone
        channel must have its rounds ordered by other means (the tests synchronize)."""
        if self._cap is None:
            raise RuntimeError("wait without a put")
        cap, W = self._cap, self._width
        # a captured wait runs at replay: `graph_replayed` bounds it then
        live = self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
        dog = self._watchdog if live else None
        if dog is not None:
            dog.arm(self.deadline_s, self._outstanding)
        self._k.wait(self.flags, self._seq, self.recv_counts, self.status, self._abort,
                     self.max_spins, cap, self.max_chunks)
        if dog is not None:
            if self.device.type != "cuda":  # the interpreter ran the wait: it is over
                dog.disarm()
            else:
                self._queued.record()  # the watchdog aborts only while this is pending
        self._cap = None
        if live:
            self.exchanges += 1
            self._unsettled = True
        return self.data[:self.world_size * cap * W].view(self.world_size * cap, W)

    def graph_replayed(self, waits: int) -> None:
        """A CUDA graph holding `waits` of this channel's waits was just launched on the
        current stream: bound it like eager waits (the watchdog armed, pending until an
        event recorded behind the replay), to be settled as they are. A capture records
        no event, so a replay's waits are armed here, after launch, not in :meth:`wait`."""
        if self._queued is not None:
            self._queued.record()
        if self._watchdog is not None:
            self._watchdog.arm(self.deadline_s, self._outstanding)
        self.exchanges += waits
        self._unsettled = True

    def abort(self) -> None:
        """Make every wait of this channel (and of the channels sharing its abort word)
        end now, failed (host; kernels may be spinning)."""
        self._abort[0] = 1

    def failed(self) -> bool:
        """Whether a wait ended without its blocks (reads the device: a sync)."""
        return bool(int(self.status.max()))

    def settle(self, deadline_s: float, op: str = "peer_exchange") -> None:
        """Wait for everything queued on the current stream, at most `deadline_s`;
        past it, abort the waits (so the stream drains). Raises CollectiveError if a
        wait failed, or if the stream does not drain within a second deadline. Returns
        at once when no wait was queued since the last settle."""
        if not self._unsettled:
            return
        try:
            self._settle(deadline_s, op)
            self._unsettled = False
        finally:
            if self._watchdog is not None:
                self._watchdog.disarm()

    def _settle(self, deadline_s: float, op: str) -> None:
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            if not _until(done.query, deadline_s):
                self.abort()
                if not _until(done.query, deadline_s):
                    raise CollectiveError(op, self.epoch, self.rank,
                                          f"stream not drained {deadline_s} s after abort")
        if self.failed():
            raise CollectiveError(op, self.epoch, self.rank,
                                  f"a peer's block missed the deadline ({deadline_s} s) "
                                  f"or the exchange was aborted")


    def close(self) -> None:
        """Stop the watchdog (the buffers belong to the `PeerMemory`)."""
        if self._watchdog is not None:
            self._watchdog.close()


def new_abort_word(device: torch.device) -> torch.Tensor:
    """A zeroed abort word for channels on `device` (pinned host memory on CUDA)."""
    return torch.zeros(1, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")


def open_moe_channels(comm, device: torch.device, tokens: int, top_k: int, hidden: int,
                      dtype: torch.dtype, epoch: int, deadline_s: float, lanes: int = 1
                      ) -> tuple[PeerMemory, tuple[PeerExchange, ...]]:
    """Collective over `comm`'s world: its symmetric memory on `device` and the MoE
    layer's channels for steps of up to `tokens` tokens per rank, a pair per lane (one
    per micro-batch that exchanges at the same time): dispatch (rows of `hidden` plus the
    pair's 16 bytes of metadata) and combine (rows of `hidden`), in that order."""
    if lanes not in (1, 2):
        raise ValueError(f"lanes must be 1 or 2, got {lanes}")
    peers = open_peer_memory(comm, device)
    rows, word = tokens * top_k, new_abort_word(device)  # one abort ends every channel
    channels = tuple(PeerExchange(peers, f"{name}{'' if lane == 0 else lane}", rows, width,
                                  dtype, epoch=epoch, deadline_s=deadline_s, abort_word=word)
                     for lane in range(lanes)
                     for name, width in (("dispatch", hidden + 16 // dtype.itemsize),
                                         ("combine", hidden)))
    return peers, channels


class _Watchdog:
    """Calls `expire()` once an armed deadline passes while the armed `pending()` still
    holds (a wait that finished in time is no fault, settled or not); each `arm` moves
    the deadline to `deadline_s` from now, `disarm` clears it. One daemon thread, asleep
    while disarmed."""

    def __init__(self, expire, name: str) -> None:
        self._expire = expire
        self._pending = lambda: True
        self._cond = threading.Condition()
        self._end: float | None = None
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def arm(self, deadline_s: float, pending) -> None:
        with self._cond:
            self._end = time.monotonic() + deadline_s
            self._pending = pending
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._end = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._end is None:
                    self._cond.wait()
                    continue
                left = self._end - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._end = None
                if self._pending():
                    self._expire()


def _until(ready, deadline_s: float) -> bool:
    """Poll `ready()` until it is true (True) or `deadline_s` passes (False)."""
    end = time.monotonic() + deadline_s
    while not ready():
        if time.monotonic() > end:
            return False
        time.sleep(50e-6)
    return True
