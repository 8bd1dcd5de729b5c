"""One rank's engine: admission, the step loop, and the state it reports.

`step()` schedules a batch, runs it, samples, and returns each request's new tokens.
Inputs are validated on admission, so a bad request is refused with a `ValueError`
before it touches the scheduler and the engine stays usable.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Optional, Sequence as Seq

import torch

from ..config import EngineConfig
from ..kernels.batch_invariant import batch_invariant
from ..log import get_logger
from ..models.loader import load_model
from ..models.parallel import ExpertParallel, ModelComm
from ..models.qwen3_moe import CausalLM
from ..models.shard import ModelShard
from .block_pool import BlockPool
from .compile_watch import compile_watch, keep_compiled_kernels
from .grammars import Grammars
from .kv_memory import allocate_kv_cache, num_pages_for_memory, torch_dtype
from .model_runner import BatchInputs, ModelRunner, PendingTokens, StepSamples
from .outputs import StepOutput
from .prompt_check import check_prompt
from .sampling_params import SamplingParams
from .scheduler import FinishedSequence, ScheduledBatch, Scheduler
from .sequence import Sequence
from .warmup import WarmupReport, run_warmup, warmup_rounds

log = get_logger(__name__)


class LLMEngine:
    """Owns the model shard, the KV cache, the block pool and the scheduler of one rank."""

    def __init__(self, config: EngineConfig, shard: ModelShard = ModelShard(),
                 comm: Optional[ModelComm] = None, ep: Optional[ExpertParallel] = None,
                 model: Optional[CausalLM] = None) -> None:
        """`comm`/`ep`: the shard's peers (multi-rank groups); `model`: an already built
        shard (benchmarks), otherwise loaded from the folder."""
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            keep_compiled_kernels()
            batch_invariant(config.batch_invariant)  # before any graph is captured
        dtype = torch_dtype(config.torch_dtype_name)
        self.model = model if model is not None else load_model(
            config.model_path, config.model, shard, self.device, dtype, comm, ep,
            quantize=config.quantization == "fp8", load_format=config.load_format,
            tp_invariant_width=config.tp_invariant_width or 1)
        cache = config.cache
        self.num_pages = cache.num_pages or num_pages_for_memory(self.model, cache, dtype, self.device)
        self.pool = BlockPool(self.num_pages, cache.page_size, cache.enable_prefix_caching)
        caches = allocate_kv_cache(self.model, self.num_pages, cache.page_size, dtype, self.device)
        self.runner = ModelRunner(self.model, caches, cache.page_size, self.device,
                                  max_model_len=config.max_model_len,
                                  cuda_graph_max_batch=0 if config.enforce_eager
                                  else min(config.cuda_graph_max_batch, config.scheduler.max_num_seqs),
                                  eos_token_ids=tuple(config.model.eos_token_ids),
                                  prefill_graph_tokens=0 if config.enforce_eager or comm is not None
                                  or ep is not None else config.cuda_graph_max_prefill,
                                  max_rows=config.scheduler.max_num_seqs)
        self.runner.grammars = Grammars(config.model_path, config.model.vocab_size,
                                        config.model.eos_token_ids)
        self.scheduler = Scheduler(self.pool, config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens, config.max_model_len,
                                   config.model.eos_token_ids)
        self.sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.overlap = config.overlap_steps
        self._grouped = comm is not None or ep is not None
        self._compiles = compile_watch() if self.device.type == "cuda" else None
        self._compiles_at_ready: Optional[int] = None  # set once warmed up
        self._ahead: Optional[tuple[ScheduledBatch, BatchInputs, torch.Tensor]] = None  # launched, not sampled

    # -- admission -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int],
                    params: Optional[SamplingParams] = None) -> Sequence:
        """Validate and queue one request. Raises ValueError naming what is wrong."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        tokens = self.validate_prompt(prompt_token_ids, params)
        if params.seed is None and not params.greedy:
            params = params.with_seed(self._seed_rng.getrandbits(63))
        seq = Sequence(request_id, tokens, params, next(self._arrivals))
        self._attach_grammar(seq)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        log.debug("request_added", request_id=request_id, prompt_tokens=len(tokens),
                  max_tokens=params.max_tokens, greedy=params.greedy)
        return seq

    def warm_up(self) -> Optional[WarmupReport]:
        """Before serving, on a GPU and alone (no peers to step with): serve the warm-up
        plan (`engine/warmup.py`) so no kernel compiles once requests come; None where
        there is nothing to warm (CPU, `warmup` off, a rank of a group)."""
        cfg = self.config
        if self.device.type != "cuda" or not cfg.warmup or self._grouped:
            return None
        graphs = self.runner.graphs
        report = run_warmup(self, warmup_rounds(
            cfg.model.vocab_size, cfg.max_model_len, cfg.scheduler.max_num_seqs,
            cfg.scheduler.max_num_batched_tokens, graphs.sizes[-1] if graphs else 0,
            self.num_pages * self.pool.page_size))
        self._compiles_at_ready = self._compiles.total
        log.info("warmed_up", rounds=report.rounds, requests=report.requests,
                 steps=report.steps, seconds=round(report.seconds, 2),
                 kernel_compiles=self._compiles.total)
        return report

    def forget_history(self) -> None:
        """Idle: forget every request served so far (cached pages, counters)."""
        if self.has_unfinished():
            raise RuntimeError("forget_history with requests in flight")
        self.sequences.clear()
        self.pool.forget_cached()
        self.scheduler.num_preemptions = 0

    def warm_grammars(self) -> None:
        """Start loading what structured output needs (in the background)."""
        self.runner.grammars.warm()

    def _attach_grammar(self, seq: Sequence) -> None:
        """The matcher of a request with structured output, fed the output it already has
        (a resumed request's prompt tail, a prefilled request's first token)."""
        p = seq.params
        if p.structured is None:
            return
        base = seq.prompt_token_ids[len(seq.prompt_token_ids) - p.output_base:] if p.output_base else []
        seq.matcher = self.runner.grammars.matcher(p.structured, base + seq.output_token_ids)

    def validate_prompt(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        return check_prompt(prompt_token_ids, params, self.config, self.num_pages)

    # -- disaggregation: prefill here, decode elsewhere (ARCHITECTURE §2) -----------
    def add_prefill_request(self, request_id: str, prompt_token_ids: Seq[int],
                            params: SamplingParams, transfer_key: int) -> Sequence:
        """Prefill only: sample the first token, then keep the prompt's pages (rows of
        the KV stream `transfer_key`) until `release_held`. `params` must carry its seed
        when sampled, so that the decode side continues the same random stream."""
        if not params.greedy and params.seed is None:
            raise ValueError("a disaggregated sampled request needs its seed fixed up front")
        if not isinstance(transfer_key, int) or transfer_key <= 0:
            raise ValueError(f"transfer_key must be a positive int, got {transfer_key!r}")
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        seq = self.add_request(request_id, prompt_token_ids, first_only)
        seq.transfer_key, seq.hold_kv = transfer_key, True
        return seq

    def release_held(self, request_id: str) -> bool:
        return self.scheduler.release_held(request_id)

    def reserve(self, request_id: str, prompt_token_ids: Seq[int],
                prefix_root: Optional[int] = None) -> Optional[tuple[list[int], int]]:
        """Pages for a prompt's KV about to arrive and how many of its tokens they
        already hold from the prefix cache (None: no room now); `prefix_root`: the
        request's `SamplingParams.prefix_root`."""
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.scheduler.reserve(request_id, list(prompt_token_ids), prefix_root)

    def unreserve(self, request_id: str) -> bool:
        return self.scheduler.unreserve(request_id)

    def admit_prefilled(self, request_id: str, prompt_token_ids: Seq[int], first_token: int,
                        params: SamplingParams) -> Sequence:
        """Continue a request prefilled elsewhere: its prompt KV sits in the pages
        reserved under its id, `first_token` was sampled by the prefill side."""
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        tokens = self.validate_prompt(prompt_token_ids, params)
        seq = Sequence(request_id, tokens, params, next(self._arrivals))
        seq.output_token_ids.append(int(first_token))
        self._attach_grammar(seq)
        self.scheduler.admit_prefilled(seq)
        self.sequences[request_id] = seq
        return seq

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        self.sequences.pop(request_id, None)
        return seq is not None

    # -- the loop --------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        if self._ahead is not None and all(seq.is_finished for seq, _ in self._ahead[0].items):
            self._ahead = None  # launched for requests that all finished since: no output
        return self._ahead is not None or self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Run one scheduled batch; return the tokens each request gained.

        With `overlap_steps` a step launches the next one before returning, so the
        caller's and the scheduler's host work runs while the device computes; the next
        call collects it. An all-greedy decode step launches it (the same sequences, one
        token further) even before its own tokens are read back (the next step takes
        them on the device), so the device never waits for the host.
        The tokens are the same either way; a request added meanwhile joins one step
        later; a request that finished or was aborted meanwhile gets nothing from the
        launched step."""
        while True:
            work = self._take_ahead() or self._launch_scheduled()
            if work is None:
                return []
            batch, inputs, logits = work
            live = [(seq, n) for seq, n in batch.items if not seq.is_finished]
            if len(live) == len(batch.items) and self._greedy_continuation(batch, inputs):
                pending = self.runner.greedy_tokens(inputs, logits)
                self._launch_ahead(batch, inputs, pending)
                sampled = pending.result()
            else:
                sampled = self.runner.sample(inputs, logits)
            if len(live) == len(batch.items):
                break
            # Finished or aborted while the step was in flight: drop their rows and
            # launch nothing from these inputs (their rows no longer match the batch).
            batch, inputs = ScheduledBatch(live), None
            sampled = sampled.only(seq.request_id for seq, _ in live)
            if live:
                break
        finished = self._advance(batch, sampled)
        if self.overlap and self._ahead is None:
            self._launch_following(batch, inputs, finished)
        return self._outputs(sampled, finished)

    def _launch_following(self, batch: ScheduledBatch, inputs: Optional[BatchInputs],
                          finished: dict) -> None:
        """After `batch`'s update: launch the next step now. The same sequences one token
        further are derived from `inputs` (O(batch)); anything else (admissions,
        prefill chunks, a batch that lost members) is scheduled and prepared in full."""
        if inputs is not None and inputs.decode_only and not finished:
            self._launch_ahead(batch, inputs)
        if self._ahead is None:
            self._ahead = self._launch_scheduled()

    def _greedy_continuation(self, batch: ScheduledBatch, inputs: BatchInputs) -> bool:
        return (self.overlap and inputs.decode_only
                and all(seq.params.plain_greedy for seq, _ in batch.items))

    def _take_ahead(self):
        work, self._ahead = self._ahead, None
        return work

    def _launch_scheduled(self):
        planned = self.schedule()
        if planned is None:
            return None
        batch, inputs = planned
        return batch, inputs, self.execute(inputs)

    # -- one step as three public parts (what a rank of a group runs in lockstep) ------
    def schedule(self) -> Optional[tuple[ScheduledBatch, BatchInputs]]:
        """The next batch and its prepared inputs, or None when nothing is runnable."""
        batch = self.scheduler.schedule()
        if not batch:
            return None
        now = time.monotonic()
        for seq, _ in batch.items:
            seq.scheduled_at = seq.scheduled_at or now
        return batch, self.runner.prepare(batch)

    def execute(self, inputs: BatchInputs, layer_done=None, microbatches: int = 1):
        """The batch's forward (the model's logits for its sampled rows); `layer_done(i)`
        is called after layer i (a prefill rank streams that layer's KV); `microbatches`:
        1, or 2 for a DP×EP step as two overlapped micro-batches."""
        return self.runner.forward(inputs, layer_done, microbatches=microbatches)

    def update(self, batch: ScheduledBatch, inputs: BatchInputs, logits) -> list[StepOutput]:
        """Sample the step's tokens, advance the scheduler, one output per token."""
        return self.step_outputs(batch, self.runner.sample(inputs, logits))

    def _launch_ahead(self, batch: ScheduledBatch, inputs: BatchInputs,
                      pending: Optional[PendingTokens] = None) -> None:
        """Launch the step after `batch` if it is the same sequences one token further:
        after `batch`'s update, or before it with `pending` (its tokens still on the
        device)."""
        following = self.scheduler.continue_decode(batch, in_flight=pending is not None)
        if following is not None:
            ids = None if pending is None else pending.device
            nxt = self.runner.prepare_next(inputs, following, input_ids=ids)
            self._ahead = (following, nxt, self.runner.forward(nxt))

    def step_outputs(self, batch: ScheduledBatch, sampled: StepSamples) -> list[StepOutput]:
        """Advance the scheduler with a step's sampled tokens; one output per token."""
        return self._outputs(sampled, self._advance(batch, sampled))

    def _advance(self, batch: ScheduledBatch, sampled: StepSamples) -> dict[str, FinishedSequence]:
        for rid, scored in sampled.prompt_logprobs.items():
            seq = self.sequences.get(rid)
            if seq is not None:
                seq.prompt_logprobs.extend(scored)
        return {f.sequence.request_id: f for f in self.scheduler.update(batch, sampled.tokens)}

    def _outputs(self, sampled: StepSamples, finished: dict[str, FinishedSequence]
                 ) -> list[StepOutput]:
        outputs = []
        for rid, token in sampled.tokens.items():
            done = finished.get(rid)
            seq = self.sequences[rid] if done is None else done.sequence
            out = StepOutput(rid, [token], index=len(seq.output_token_ids) - 1)
            lp = sampled.logprobs.get(rid)
            if lp is not None:
                out.logprobs = [lp]
            if len(seq.output_token_ids) == 1:
                now = time.monotonic()
                out.queued_s = max(seq.scheduled_at - seq.added_at, 0.0)
                out.prefill_s = max(now - seq.scheduled_at, 0.0)
                if seq.params.prompt_logprobs is not None:
                    out.prompt_logprobs = [None, *seq.prompt_logprobs]
            if done is None:
                outputs.append(out)
                continue
            self.sequences.pop(rid, None)
            out.finished, out.finish_reason = True, done.reason
            out.num_cached_tokens = seq.num_cached_tokens
            outputs.append(out)
            log.debug("request_finished", request_id=rid, reason=done.reason,
                      output_tokens=len(seq.output_token_ids), cached_tokens=seq.num_cached_tokens)
        return outputs

    # -- what operators watch --------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_waiting_tokens": self.scheduler.num_waiting_tokens,
            "num_running": len(self.scheduler.running),
            "running_tokens": sum(seq.num_tokens for seq in self.scheduler.running),
            "num_pages": self.num_pages,
            "kv_capacity_tokens": self.num_pages * self.pool.page_size,
            "kv_usage": self.pool.usage,
            "prefix_hit_rate": self.pool.hit_rate,
            "prefix_hit_tokens": self.pool.hit_tokens,
            "prefix_query_tokens": self.pool.query_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            **self._compile_stats(),
        }

    def _compile_stats(self) -> dict[str, int]:
        """`kernel_compiles` (this process, since start) and, once warmed up,
        `kernel_compiles_after_ready` (none is the goal)."""
        if self._compiles is None or not self._compiles.available:
            return {}
        out = {"kernel_compiles": self._compiles.total}
        if self._compiles_at_ready is not None:
            out["kernel_compiles_after_ready"] = self._compiles.total - self._compiles_at_ready
        return out
