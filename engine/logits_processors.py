"""What changes a batch's logits before temperature and the filters, all rows at once.

Order (as `SamplingParams` documents): tokens outside `allowed_token_ids` removed; bad
words removed (the last token of a banned sequence whose other tokens end the output so
far); `logit_bias` added; `min_tokens` bars EOS and the row's `stop_token_ids` while fewer
output tokens exist; the repetition penalty (tokens of
the prompt or the output: a positive logit divided by it, a negative one multiplied);
then `frequency_penalty * count + presence_penalty * (count > 0)` subtracted, counting
the output tokens only. Each is one batched operation over the rows that use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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

    def prompt(self):
        """The prompt without a resumed request's earlier output (a list, or a numpy
        array when `prompt_ids` is one: the engine passes each prompt's cached array)."""
        base = self.params.output_base
        return self.prompt_ids[:len(self.prompt_ids) - base] if base else self.prompt_ids


def process_logits(x: torch.Tensor, rows: Sequence[RowHistory],
                   eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """`x` (float32 `[B, vocab]`, modified in place and returned) after every row's
    allow-list, bad words, bias, min-tokens bar and penalties. A row with an allow-list
    that the later steps left with no token keeps its allowed tokens alone."""
    listed = _keep_allowed(x, rows)
    kept = x[listed].clone() if listed else None
    _ban_bad_words(x, rows)
    _add_bias(x, rows)
    _bar_stops(x, rows, eos_token_ids)
    _penalize(x, rows)
    if listed:
        empty = torch.isneginf(x[listed]).all(dim=1, keepdim=True)
        x[listed] = torch.where(empty, kept, x[listed])
    return x


def _keep_allowed(x: torch.Tensor, rows: Sequence[RowHistory]) -> list[int]:
    """Remove every token outside each row's `allowed_token_ids`; the rows that have one."""
    listed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not listed:
        return listed
    keep = torch.zeros(len(listed), x.shape[1], dtype=torch.bool, device=x.device)
    pairs = _token_rows([rows[i].params.allowed_token_ids for i in listed], range(len(listed)))
    pairs = torch.from_numpy(pairs).to(x.device)
    keep[pairs[0], pairs[1]] = True
    x[listed] = x[listed].masked_fill(~keep, float("-inf"))
    return listed


def _ban_bad_words(x: torch.Tensor, rows: Sequence[RowHistory]) -> None:
    """For each banned sequence, its last token where the output ends with the rest
    (output tokens only: a prompt's tail does not start a bad word)."""
    pairs = []
    for i, r in enumerate(rows):
        words = r.params.bad_words_token_ids
        if not words:
            continue
        out = r.outputs()
        for w in words:
            head = len(w) - 1
            if head <= len(out) and (head == 0 or out[len(out) - head:] == list(w[:head])):
                pairs.append((i, w[-1]))
    if pairs:
        idx = torch.tensor(pairs, dtype=torch.long, device=x.device)
        x[idx[:, 0], idx[:, 1]] = float("-inf")


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


def _token_rows(lists: Sequence[Sequence[int]], rows: Sequence[int]) -> np.ndarray:
    """`[2, N]` (row, token) pairs of every token of `lists[k]` in row `rows[k]`."""
    arrays = [np.asarray(ts, dtype=np.int64) for ts in lists]
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return np.stack([np.repeat(np.asarray(rows, dtype=np.int64), lengths), tokens])


def _penalize(x: torch.Tensor, rows: Sequence[RowHistory]) -> None:
    """Every penalty of every row in a few whole-batch operations: one `[B, vocab]` count
    of output tokens, one mark of prompt tokens (rows with a repetition penalty)."""
    which = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
             or r.params.frequency_penalty or r.params.presence_penalty]
    if not which:
        return
    device = x.device
    repeat = [i for i in which if rows[i].params.repetition_penalty != 1.0]
    outputs = _token_rows([rows[i].outputs() for i in which], which)
    prompts = _token_rows([rows[i].prompt() for i in repeat], repeat)
    pairs = torch.from_numpy(np.concatenate([outputs, prompts], axis=1)).to(device)
    n_out = outputs.shape[1]
    counts = torch.zeros_like(x)
    counts.index_put_((pairs[0, :n_out], pairs[1, :n_out]),
                      torch.ones(n_out, device=device), accumulate=True)
    params = torch.tensor([[r.params.repetition_penalty, r.params.frequency_penalty,
                            r.params.presence_penalty] for r in rows],
                          dtype=x.dtype, device=device)
    rep, freq, pres = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    if repeat:
        seen = counts > 0
        seen[pairs[0, n_out:], pairs[1, n_out:]] = True
        seen &= rep != 1.0
        x.copy_(torch.where(seen, torch.where(x > 0, x / rep, x * rep), x))
    x.sub_(freq * counts + pres * (counts > 0).to(x.dtype))
