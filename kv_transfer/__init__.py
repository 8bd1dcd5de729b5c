"""The KV cache from prefill to decode ranks (ARCHITECTURE §4), in two parts, the
dependency strictly downward (transport uses planning, never the other way):

- `planning/` — plain logic, no I/O: `layout` (a side's KV layout), `planner` (which head
  and token ranges go from which prefill rank to which decode rank), `copy_table` and
  `packed_table` (the same as int32 tables), `spans` (copies that are whole page runs on
  both sides), `messages` (the msgspec wire structs).
- `transport/` — moving the bytes: UCX via ucxx, host or device staging, deadlines and
  fencing; `transport.protocols` is the sender/receiver contract the prefill and decode
  roles hold (`actors/rank/`), `transport.blocking` its implementation.
"""
