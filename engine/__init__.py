"""One rank's engine.

`llm_engine.LLMEngine` is a single engine: `sequence` (a request's tokens and state),
`block_pool` (paged KV, prefix hashing), `scheduler` (token budgets, chunked prefill,
preemption; no prefill/decode phases), `model_runner` (batch inputs, forward, CUDA
graphs via `cuda_graphs`), `sampler` (seeded per request and position) and
`sampling_params`; its step is `schedule` → `execute` → `update`.
`rank_engine.RankEngine` runs that cycle in lockstep with a group (`plan`: the TP
leader's step plan; `group_graphs`: a DP×EP group's decode steps as CUDA graphs;
`rank_spec`: where a rank sits and its shard). `prompt_check` is shared with the
drivers, `outputs` is what leaves a step.

Depends on `models`, `kernels`, `config`; never on Ray.
"""
