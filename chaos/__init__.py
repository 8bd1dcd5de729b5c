"""Chaos engineering against a running phalanx (`phalanx chaos`): faults from outside the
server (`faults`, `schedule`, `injectors`: signals, Ray actor kills, node loss, internal
fault points reached through named rank actors), a streamed workload through the SDK
(`workload`), a Jepsen-style check of every stream's tokens against a fault-free
reference (`checker`), the drill itself (`runner`) and its report (`report`); `ranks`
finds rank processes through Ray's state. `drill` is the kill drill the tests and
`bench/kill_drills.py` run in-process. Imports the SDK and Ray, never the serving code."""
