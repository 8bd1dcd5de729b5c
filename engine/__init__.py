"""One rank's engine.

`llm_engine.LLMEngine` is a single engine: `sequence` (a request's tokens and state),
`block_pool` (paged KV, prefix hashing), `scheduler` (token budgets, chunked prefill,
preemption; no prefill/decode phases), `model_runner` (batch inputs, forward, CUDA
graphs via `cuda_graphs`), `sampler` (seeded per request and position) and
`sampling_params`; its step is `schedule` → `execute` → `update`.
A rank of a group runs that cycle in lockstep (`actors/rank/`). `prompt_check` is shared
with the drivers, `outputs` is what leaves a step.

Depends on `models`, `kernels`, `config`; never on Ray.
"""
