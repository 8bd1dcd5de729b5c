"""Numeric hot spots behind one small interface each, with a torch reference (CPU, the
oracle) and Triton versions for the GPU (`gpu/`): `attention`, `moe`, `linear`, `norm`,
`rope`, `activation`; `backend` picks the implementation.

Also here for now (issue 27 moves them to `comm/`): how ranks talk — `comm.GroupComm`
(gloo/NCCL with deadlines and epochs), `dispatch` (MoE dispatch/combine),
`peer_exchange` / `peer_memory` (symmetric memory), `local_channels`,
`shm_agreement`, `shm_broadcast`, `shm_collectives` (shared memory on one machine).

Depends on torch and triton only.
"""
