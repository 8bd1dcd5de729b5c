"""Runs one scheduled batch through the model over the paged KV cache.

KV layout: per layer one K pool and one V pool, `[num_pages, kv_heads, page_size,
head_dim]` (HND per page), so a head range of a page is one contiguous slab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..log import get_logger
from ..kernels.attention import AttentionMetadata
from ..models.qwen3_moe import CausalLM, KVCache
from ..models.stages import interleave, run_to_end
from .cuda_graphs import DecodeGraphs
from .prefill_graphs import PrefillGraphs
from .microbatches import micro_batches
from .logits_processors import RowHistory
from .logprobs import TokenLogprob, token_logprobs
from .sampler import sample_batch
from .scheduler import ScheduledBatch
from .sequence import Sequence

log = get_logger(__name__)

class HostStaging:
    """Reusable host buffers for step inputs, pinned on GPU machines so copies are async.

    The runner keeps two and alternates per step: a step's copies are queued behind the
    step before it, so refilling the buffers of step n+1 must wait only for step n-1's
    copies, which are done once step n-1's tokens were read back (they preceded its
    forward); that always happened before step n+1 is prepared."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._bufs: dict[str, torch.Tensor] = {}

    def put(self, name: str, values: np.ndarray) -> torch.Tensor:
        n = values.size
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != _TORCH_OF[values.dtype.type]:
            buf = torch.empty(max(n, 1024), dtype=_TORCH_OF[values.dtype.type], pin_memory=self.pin)
            self._bufs[name] = buf
        out = buf[:n].view(values.shape)
        out.copy_(torch.from_numpy(values))
        return out


_TORCH_OF = {np.int32: torch.int32, np.int64: torch.int64}


@dataclass(slots=True)
class BatchInputs:
    """One step's flattened inputs on the host, and which sequences are sampled."""

    host: dict[str, torch.Tensor]
    max_query_len: int
    max_seq_len: int
    sampled: list[Sequence]
    # The numpy arrays `host` was filled from (staging buffers are reused, these are
    # not), so the next decode step can be derived from them.
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # Rows of the logits beyond the sampled ones: prompt positions whose next token's
    # logprob was asked for, as (sequence, first logits row, rows, first position). With
    # any, `sample_rows` are the logits rows of `sampled` (else rows 0..len(sampled)-1).
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    sample_rows: Optional[list[int]] = None

    @property
    def num_logits(self) -> int:
        return self.host["logits_indices"].shape[0]

    @property
    def decode_only(self) -> bool:
        """Every row is one token that gets sampled: the case CUDA graphs cover."""
        return (self.max_query_len == 1 and not self.prompt_rows
                and self.num_logits == self.host["input_ids"].shape[0])


@dataclass(slots=True)
class StepSamples:
    """A step's sampled token per request id, and what was reported with them: the
    token's `TokenLogprob` (requests with `logprobs`), prompt logprobs computed this step
    (requests with `prompt_logprobs`, in position order, a chunk at a time)."""

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)

    def only(self, request_ids) -> "StepSamples":
        keep = set(request_ids)
        return StepSamples({r: t for r, t in self.tokens.items() if r in keep},
                           {r: v for r, v in self.logprobs.items() if r in keep},
                           {r: v for r, v in self.prompt_logprobs.items() if r in keep})


@dataclass(slots=True)
class PendingTokens:
    """Greedy tokens of a launched step: `device` on the device at once, `host` once
    `event` (None on CPU) has completed."""

    device: torch.Tensor
    host: torch.Tensor
    event: Optional[torch.cuda.Event]
    request_ids: list[str]

    def result(self) -> StepSamples:
        if self.event is not None:
            self.event.synchronize()
        return StepSamples(dict(zip(self.request_ids, self.host.tolist())))


class ModelRunner:
    """Builds batch metadata, runs the model, samples the sequences that reached their end."""

    def __init__(self, model: CausalLM, caches: list[KVCache], page_size: int,
                 device: torch.device, max_model_len: int = 0, cuda_graph_max_batch: int = 0,
                 eos_token_ids: tuple[int, ...] = (), prefill_graph_tokens: int = 0,
                 max_rows: int = 0) -> None:
        """`cuda_graph_max_batch`: decode steps of up to that many rows replay CUDA graphs;
        `prefill_graph_tokens`: other steps of up to that many tokens over up to
        `max_rows` rows too (engine/prefill_graphs.py). Both on a GPU only."""
        self.model = model
        self.eos_token_ids = eos_token_ids  # barred from rows short of their min_tokens
        self.grammars = None  # engine/grammars.Grammars once a request has structured output
        self.caches = caches
        self.page_size = page_size
        self.device = device
        self._max_pages = -(-max_model_len // page_size) if max_model_len else 1 << 30
        self._stagings = [HostStaging(pin=device.type == "cuda") for _ in range(2)]
        self._steps = 0
        self.graphs = None
        self.auto_graphs = True  # False: replay only the size `forward` is told (groups)
        self.lanes = None  # engine/lanes.Lanes: two micro-batches over two pairs of peer channels
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            self.graphs = DecodeGraphs(model, caches, cuda_graph_max_batch, max_model_len,
                                       page_size, device)
            self.graphs.capture()
        self.prefill_graphs = None
        if device.type == "cuda" and prefill_graph_tokens > 0 and max_rows > 0:
            self.prefill_graphs = PrefillGraphs(model, caches, prefill_graph_tokens, max_rows,
                                                max_model_len, page_size, device)
            self.prefill_graphs.capture()

    def prepare(self, batch: ScheduledBatch) -> BatchInputs:
        """Flatten the batch: token ids, positions, KV slots, per-sequence lengths."""
        ps = self.page_size
        num_tokens = batch.num_tokens
        ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        starts = np.zeros(len(batch.items) + 1, dtype=np.int32)
        seq_lens = np.empty(len(batch.items), dtype=np.int32)
        max_pages = max(len(seq.pages) for seq, _ in batch.items)
        # the width rounded up to 16 pages (within the longest sequence's): the kernels'
        # row stride then falls in one of Triton's specialisation classes, not three
        max_pages = max(max_pages, min(-(-max_pages // 16) * 16, self._max_pages))
        tables = np.zeros((len(batch.items), max_pages), dtype=np.int32)
        row_keys = np.zeros(len(batch.items), dtype=np.int64)
        logits_idx, sampled, sample_rows, prompt_rows = [], [], [], []
        t = 0
        for row, (seq, n) in enumerate(batch.items):
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            pages = seq.pages
            tables[row, :len(pages)] = pages
            row_keys[row] = seq.transfer_key
            if n == 1:  # decode rows: scalar work, no temporary arrays
                ids[t] = seq.token_id(begin)
                positions[t] = begin
                slots[t] = pages[begin // ps] * ps + begin % ps
            else:
                pos = np.arange(begin, end, dtype=np.int64)
                ids[t:t + n] = seq.token_slice(begin, end)
                positions[t:t + n] = pos
                slots[t:t + n] = np.asarray(pages, dtype=np.int64)[pos // ps] * ps + pos % ps
            if seq.params.prompt_logprobs is not None and not seq.output_token_ids:
                last = min(end, seq.num_prompt_tokens - 1)  # position p scores token p + 1
                if last > begin:
                    prompt_rows.append((seq, len(logits_idx), last - begin, begin))
                    logits_idx.extend(range(t, t + last - begin))
            t += n
            starts[row + 1] = t
            seq_lens[row] = end
            if end == seq.num_tokens:
                sample_rows.append(len(logits_idx))
                logits_idx.append(t - 1)
                sampled.append(seq)
        arrays = dict(input_ids=ids, positions=positions, slot_mapping=slots,
                      query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
                      logits_indices=np.asarray(logits_idx, dtype=np.int64), row_keys=row_keys)
        inputs = self._stage(arrays, int(max(n for _, n in batch.items)), sampled)
        if prompt_rows:
            inputs.prompt_rows, inputs.sample_rows = prompt_rows, sample_rows
        return inputs

    def _stage(self, arrays: dict[str, np.ndarray], max_query_len: int,
               sampled: list[Sequence]) -> BatchInputs:
        staging = self._stagings[self._steps % 2]
        self._steps += 1
        host = {k: torch.from_numpy(v) if k == "row_keys" else staging.put(k, v)
                for k, v in arrays.items()}
        return BatchInputs(host, max_query_len, int(arrays["seq_lens"].max()), sampled, arrays)

    def prepare_next(self, prev: BatchInputs, batch: ScheduledBatch,
                     input_ids: Optional[torch.Tensor] = None) -> BatchInputs:
        """`prepare(batch)` for the decode step right after `prev` over the same
        sequences (each one token further, pages already grown), derived from `prev`'s
        arrays: O(batch) numpy work instead of rebuilding every block table row.
        `input_ids`: the tokens `prev` sampled, still on the device (not read back yet:
        the step is queued behind `prev` and takes them from there)."""
        ps, a = self.page_size, prev.arrays
        seqs = [seq for seq, _ in batch.items]
        if not prev.decode_only or len(seqs) != len(prev.sampled):
            raise ValueError("prepare_next continues a decode-only step over the same sequences")
        positions = a["positions"] + 1
        tables = a["block_tables"]
        width = max(len(seq.pages) for seq in seqs)
        if width > tables.shape[1]:
            tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
        else:
            tables = tables.copy()
        page_idx = positions // ps
        for row in np.flatnonzero(positions % ps == 0):  # these rows start a new page
            tables[row, page_idx[row]] = seqs[row].pages[page_idx[row]]
        rows = np.arange(len(seqs))
        if input_ids is None:
            ids = np.fromiter((seq.token_id(seq.num_computed_tokens) for seq in seqs),
                              dtype=np.int64, count=len(seqs))
        else:
            ids = np.zeros(len(seqs), dtype=np.int64)  # placeholder: the ids stay on the device
        arrays = dict(a, positions=positions, block_tables=tables, seq_lens=a["seq_lens"] + 1,
                      input_ids=ids,
                      slot_mapping=tables[rows, page_idx].astype(np.int64) * ps + positions % ps)
        inputs = self._stage(arrays, 1, seqs)
        if input_ids is not None:
            inputs.host["input_ids"] = input_ids
        return inputs

    def greedy_tokens(self, inputs: BatchInputs, logits: torch.Tensor) -> "PendingTokens":
        """Start reading back the arg-max token of every sampled row (all greedy): the
        device tensor feeds a step queued behind this one, the host copy is waited on
        with `PendingTokens.result()` (which does not wait for that later step)."""
        ids = torch.argmax(logits, dim=-1)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(ids, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(ids, host, event, [s.request_id for s in inputs.sampled])

    def _run_eager(self, inputs: BatchInputs, layer_done=None, microbatches: int = 1) -> torch.Tensor:
        dev = {k: v.to(self.device, non_blocking=True) for k, v in inputs.host.items()
               if k != "row_keys"}
        if microbatches == 2:  # two-batch overlap
            parts = micro_batches(dev, inputs.host)
            stages = [(lambda: self.model.dummy_stages()) if p is None
                      else (lambda p=p: self.model.stages(p[0], p[1], self.caches, p[2]))
                      for p in parts]
            if self.lanes is not None and self.lanes.ready():  # each on its lane
                hidden = self.lanes.run([lambda s=s: run_to_end(s()) for s in stages])
            else:  # the stages interleaved, exchanges on the exchange thread
                hidden = interleave([s() for s in stages])
            hidden = torch.cat([h for h, p in zip(hidden, parts) if p is not None])
        else:
            meta = AttentionMetadata(
                query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
                block_tables=dev["block_tables"], slot_mapping=dev["slot_mapping"],
                max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len)
            hidden = self.model(dev["input_ids"], dev["positions"], self.caches, meta, layer_done)
        return self.model.compute_logits(hidden[dev["logits_indices"]])

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs, layer_done=None,
                graph_size: Optional[int] = None, microbatches: int = 1) -> torch.Tensor:
        """Logits of the rows to sample (every row of a decode batch), `[L, vocab]`.

        `layer_done(i)`: called after layer i (eager only; streams KV while computing).
        `graph_size`: replay that captured size (a decode batch that fits it); without
        it a decode batch replays the smallest size that fits, unless `auto_graphs` is
        off (a DP×EP group, whose ranks must replay alike: the group decides).
        `microbatches=2`: the step as two micro-batches whose MoE exchanges overlap the
        other's compute (eager: `engine/microbatches.py`; with `graph_size`, that size's
        split graph; the group decides, every rank alike)."""
        if microbatches not in (1, 2):
            raise ValueError(f"microbatches must be 1 or 2, got {microbatches}")
        if microbatches == 2:
            if layer_done is not None:
                raise ValueError("two micro-batches run without a layer hook")
            if graph_size is None:
                return self._run_eager(inputs, microbatches=2)
        elif (graph_size is None and self.auto_graphs and layer_done is None
                and self.graphs is not None and inputs.decode_only
                and self.graphs.fits(inputs.num_logits)):
            graph_size = self.graphs.size_for(inputs.num_logits)
        if graph_size is None:
            if (microbatches == 1 and layer_done is None and self.auto_graphs
                    and self.prefill_graphs is not None and not inputs.decode_only
                    and self.prefill_graphs.fits(inputs.host["input_ids"].shape[0],
                                                 inputs.host["seq_lens"].shape[0],
                                                 inputs.num_logits)):
                return self.prefill_graphs.run(inputs.host)
            return self._run_eager(inputs, layer_done)
        h = inputs.host
        return self.graphs.run(h["input_ids"], h["positions"], h["slot_mapping"],
                               h["seq_lens"], h["block_tables"], graph_size,
                               split=microbatches == 2)

    @torch.inference_mode()
    def dummy_forward(self, microbatches: int = 1) -> None:
        """An idle rank's part in a DP×EP group's eager step: the MoE exchanges of
        `microbatches` empty micro-batches, on their lanes where the step has them."""
        if microbatches == 2 and self.lanes is not None and self.lanes.ready():
            self.lanes.run([lambda: run_to_end(self.model.dummy_stages())] * 2)
        else:
            self.model.dummy_forward(microbatches)

    def sample(self, inputs: BatchInputs, logits: torch.Tensor) -> StepSamples:
        """One token for each sequence whose step reached its end, with the logprobs
        its request asked for; the prompt logprobs of this step's prompt rows."""
        out = StepSamples({})
        # Grammar masks first: on a GPU the forward is still running meanwhile.
        constrained = [i for i, s in enumerate(inputs.sampled) if s.matcher is not None]
        allowed = None
        if constrained:
            allowed = (constrained, self.grammars.allowed(
                [inputs.sampled[i].matcher for i in constrained], logits.device))
        if inputs.prompt_rows:
            out.prompt_logprobs = prompt_logprobs(inputs.prompt_rows, logits)
            logits = logits[inputs.sample_rows]
        if not inputs.sampled:
            return out
        rows = [RowHistory(s.params, s.prompt_array() if s.params.repetition_penalty != 1.0
                           else s.prompt_token_ids, s.output_token_ids)
                for s in inputs.sampled]
        result = sample_batch(logits, rows, [s.num_tokens for s in inputs.sampled],
                              self.eos_token_ids, allowed)
        for i in constrained:
            seq = inputs.sampled[i]
            error = self.grammars.advance(seq.matcher, result.tokens[i])
            if error is not None:
                log.warning("grammar_rejected_token", request_id=seq.request_id, error=error)
        out.tokens = {s.request_id: t for s, t in zip(inputs.sampled, result.tokens)}
        out.logprobs = {s.request_id: lp for s, lp in zip(inputs.sampled, result.logprobs)
                        if lp is not None}
        return out


def prompt_logprobs(prompt_rows: list[tuple[Sequence, int, int, int]], logits: torch.Tensor
                    ) -> dict[str, list[TokenLogprob]]:
    """Per request: the logprob of each prompt token scored by these rows (position p's
    row scores token p + 1) under the model's raw distribution, one batched pass."""
    index, targets, ks = [], [], []
    for seq, row, count, first in prompt_rows:
        index.extend(range(row, row + count))
        targets.extend(seq.prompt_token_ids[first + 1:first + 1 + count])
        ks.extend([seq.params.prompt_logprobs] * count)
    device = logits.device
    lp = torch.log_softmax(logits[torch.tensor(index, device=device)].float(), dim=1)
    flat = token_logprobs(lp, torch.tensor(targets, device=device), ks)
    out, at = {}, 0
    for seq, _, count, _ in prompt_rows:
        out[seq.request_id] = flat[at:at + count]
        at += count
    return out
