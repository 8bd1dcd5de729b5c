"""What changes a batch's logits before temperature and the filters, all rows at once.

Order (as `SamplingParams` documents): `logit_bias` added; `min_tokens` bars EOS and the
row's `stop_token_ids` while fewer output tokens exist; the repetition penalty (tokens of
the prompt or the output: a positive logit divided by it, a negative one multiplied);
then `frequency_penalty * count + presence_penalty * (count > 0)` subtracted, counting
the output tokens only. Each is one batched operation over the rows that use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

__all__ = ["RowHistory", "process_logits"]


@dataclass(frozen=True, slots=True)
class RowHistory:
    """What one row's processors read: its params and token history (references to
    the sequence's lists, not copies). The last `params.output_base` prompt tokens are
    output of an earlier run of the same request (a resumed one)."""

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + self.params.output_base

    def outputs(self) -> list[int]:
        base = self.params.output_base
        head = list(self.prompt_ids[len(self.prompt_ids) - base:]) if base else []
        return head + list(self.output_ids)

    def prompt(self) -> list[int]:
        base = self.params.output_base
        return list(self.prompt_ids[:len(self.prompt_ids) - base] if base else self.prompt_ids)


def process_logits(x: torch.Tensor, rows: Sequence[RowHistory],
                   eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """`x` (float32 `[B, vocab]`, modified in place and returned) after every row's
    bias, min-tokens bar and penalties."""
    _add_bias(x, rows)
    _bar_stops(x, rows, eos_token_ids)
    _penalize(x, rows)
    return x


def _add_bias(x: torch.Tensor, rows: Sequence[RowHistory]) -> None:
    pairs = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    if not pairs:
        return
    idx = torch.tensor([(i, t) for i, t, _ in pairs], dtype=torch.long, device=x.device)
    bias = torch.tensor([b for _, _, b in pairs], dtype=x.dtype, device=x.device)
    x.index_put_((idx[:, 0], idx[:, 1]), bias, accumulate=True)


def _bar_stops(x: torch.Tensor, rows: Sequence[RowHistory], eos: Sequence[int]) -> None:
    pairs = []
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and r.num_output < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            pairs.extend((i, t) for t in stops if t < x.shape[1])
    if pairs:
        idx = torch.tensor(pairs, dtype=torch.long, device=x.device)
        x[idx[:, 0], idx[:, 1]] = float("-inf")


def _counts(rows: Sequence[RowHistory], which: Sequence[int], tokens_of, vocab: int,
            device: torch.device) -> torch.Tensor:
    """`[len(which), vocab]` counts of each row's tokens (`tokens_of(row)`)."""
    lists = [tokens_of(rows[i]) for i in which]
    counts = torch.zeros(len(which), vocab, dtype=torch.float32, device=device)
    flat = [t for ts in lists for t in ts]
    if flat:
        row_of = torch.repeat_interleave(torch.arange(len(which)),
                                         torch.tensor([len(ts) for ts in lists]))
        idx = torch.stack([row_of, torch.tensor(flat)]).to(device)
        counts.index_put_((idx[0], idx[1]), torch.ones(len(flat), device=device), accumulate=True)
    return counts


def _penalize(x: torch.Tensor, rows: Sequence[RowHistory]) -> None:
    vocab, device = x.shape[1], x.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = _counts(rows, rep, lambda r: r.prompt() + r.outputs(), vocab, device) > 0
        r_pen = torch.tensor([rows[i].params.repetition_penalty for i in rep],
                             dtype=x.dtype, device=device)[:, None]
        sub = x[rep]
        shaped = torch.where(sub > 0, sub / r_pen, sub * r_pen)
        x[rep] = torch.where(seen, shaped, sub)
    freq = [i for i, r in enumerate(rows)
            if r.params.frequency_penalty or r.params.presence_penalty]
    if freq:
        counts = _counts(rows, freq, RowHistory.outputs, vocab, device)
        f = torch.tensor([rows[i].params.frequency_penalty for i in freq], device=device)[:, None]
        p = torch.tensor([rows[i].params.presence_penalty for i in freq], device=device)[:, None]
        x[freq] -= f * counts + p * (counts > 0).to(x.dtype)
