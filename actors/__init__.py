"""Ray actors and what drives them from the caller's process.

- A rank: `rank.rank.Rank` (plain, no Ray) composed of a mailbox, a lockstep part and a
  role (`rank/`); the actors `rank_actor.RankActor` / `PrefillRank` / `DecodeRank` are
  thin Ray wrappers of it with the colocated, prefill and decode roles.
- A group of ranks under an epoch: `supervisor.GroupSupervisor` (placement groups,
  formation that fails fast, deaths reported by Ray).
- Recovery and layout: `reconciler.Reconciler` (plain logic, no Ray: desired vs actual
  layout, restart intensity, width, planned re-shapes) and its thin executor
  `recovery.Recovery`; `ep_control.EPControl` asks the EP-width policy (`policies`) for
  the colocated layout's groups.
- The contract the server and `LLM` drive: `cluster.ClusterClient`, built by
  `cluster_builder.build_cluster`; its two forms `group_client.GroupClient` (the colocated
  DP×EP groups, with `group_views`) and `disagg_client.DisaggClient` (prefill instances →
  decode group, with `disagg_recovery`, `disagg_views`, `abort_cleanup`), both resuming
  requests with `resume.resume_from` and reporting held prefixes through `held_reports`.

Depends on `engine`, `comm`, `kv_transfer`, `policies`, `models` (the shard and the MoE
interface a rank builds), `config`; plain-logic parts (`reconciler`, `abort_cleanup`,
`held_reports`, `resume`) import no Ray.
"""
