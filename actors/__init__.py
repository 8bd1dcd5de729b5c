"""Ray actors and what drives them from the caller's process.

- A rank: `rank_actor.RankActor` (a thin Ray wrapper of `engine.rank_engine.RankEngine`),
  with the KV roles `prefill_rank.PrefillRank` / `decode_rank.DecodeRank` (over
  `kv_rank.KVRank`).
- A group of ranks under an epoch: `supervisor.GroupSupervisor` (placement groups,
  formation that fails fast, deaths reported by Ray).
- Recovery: `reconciler.Reconciler` (plain logic, no Ray: desired vs actual layout,
  restart intensity, width) and its thin executor `recovery.Recovery`.
- The contract the server and `LLM` drive: `cluster.ClusterClient`, built by
  `cluster_builder.build_cluster`; its two forms `group_client.GroupClient` (one colocated
  group) and `disagg_client.DisaggClient` (prefill instances → decode group, with
  `disagg_recovery`, `disagg_views`, `abort_cleanup`), both resuming requests with
  `resume.resume_from` and reporting held prefixes through `held_reports`.

Depends on `engine`, `kernels`, `kv_transfer`, `config`; plain-logic parts
(`reconciler`, `abort_cleanup`, `held_reports`, `resume`) import no Ray.
"""
