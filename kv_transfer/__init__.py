"""The KV cache from prefill to decode ranks (ARCHITECTURE §4).

Planning (plain logic): `layout` (a side's KV layout), `planner` (which head and token
ranges go from which prefill rank to which decode rank), `copy_table`, `packed_table`,
`spans`, `part_cutter`, `messages` (msgspec wire structs). Transport: `ucx_runtime`
(ucxx), `sender` / `send_connection`, `receiver` / `receive_connection`,
`direct_landing`, `staging` / `staging_memory` / `slab_copy` (host or device staging),
`transport` and `blocking` (the thread and the synchronous fronts the rank roles use),
`errors`. Issue 27 splits planning from transport into two subpackages.
"""
