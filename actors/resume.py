"""Resuming a request on a re-formed group: from its prompt plus the tokens the caller
already has. Sampling is seeded per (request seed, position), so the continuation is the
one the lost group would have produced; the new run's output index 0 is the caller's
index `len(emitted)`."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..engine.sampling_params import SamplingParams


def resume_from(prompt: Sequence[int], params: SamplingParams, emitted: Sequence[int]
                ) -> tuple[list[int], SamplingParams, int]:
    """(tokens to submit, params with the tokens still owed, output index base).
    `params` must be the request's as first submitted, seed included if it samples."""
    if not params.greedy and params.seed is None:
        raise ValueError("a sampled request resumes only with the seed it started with")
    base = len(emitted)
    left = max(params.max_tokens - base, 1)
    resumed = params
    if base:  # the caller has the prompt logprobs already; the emitted tokens are output
        resumed = dataclasses.replace(params, prompt_logprobs=None,
                                      output_base=params.output_base + base)
    return list(prompt) + list(emitted), dataclasses.replace(resumed, max_tokens=left), base
