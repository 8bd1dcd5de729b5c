"""Which KV bytes go where, as plain data (no sockets, no threads, no device code): a
side's `layout`, the resharding `planner`, its table forms `copy_table` and
`packed_table`, page-run `spans`, and the `messages` that carry plans on the wire.
Imports numpy and msgspec only; tested in milliseconds."""
