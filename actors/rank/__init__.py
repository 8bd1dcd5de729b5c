"""One rank of a group, by composition (ARCHITECTURE §1): `rank.Rank` owns the loop
thread and composes

- `mailbox.Mailbox` — inbox items for the loop, outputs and role events for callers,
  the live request ids, the loop's failure;
- `lockstep.Lockstep` — communicators, engine, MoE exchanges and `group_graphs`, and the
  step every rank of the group takes together (`plan`: the TP leader's plan on the wire;
  the DP agreement; dummy steps);
- a role (`role.RankRole`, the colocated one; `prefill_role.PrefillRole`: plan and send
  KV per layer; `decode_role.DecodeRole`: reserve, gate, admit), with `kv_side` shared by
  the two KV roles;
- `fault_points.FaultPoints` — where chaos drills place faults exactly.

`spec` is where a rank sits and its shard. Nothing here imports Ray: the actors
(`actors/rank_actor.py`) wrap a `Rank`.
"""
