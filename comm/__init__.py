"""How ranks talk (ARCHITECTURE §1, §5): every wait here ends in a result or a
:class:`~phalanx.comm.errors.CollectiveError` within its deadline, and every communicator
belongs to one epoch.

- `errors` — `CollectiveError` (a leaf).
- `rendezvous` — the TCP store a new epoch's ranks meet at; rank 0's port is bound from
  the moment its address is handed out (`held_address`).
- `group_comm` — `GroupComm`: one rank's world and TP communicators (gloo on CPU, NCCL on
  GPU) for one epoch, with deadlines; built on `local_channels`.
- `local_channels` — the shared-memory fast paths between rank processes of one machine:
  `shm_agreement` (the DP agreement), `shm_broadcast` (the TP plan), `shm_collectives`
  (TP sums and gathers), all over `shm_peers`.
- `peer_memory` — `PeerMemory`, the symmetric-memory contract, and `LocalWorld` (a world
  inside one process); backends `shm_peers` (/dev/shm files), `gpu/nvshmem_peers`
  (NVSHMEM), `gpu/ipc_peers` (CUDA IPC); `peer_backends.open_peer_memory` picks one.
  Backends import only the contract; only `peer_backends` imports the backends.
- `peer_exchange` — `PeerExchange`: the all-to-all through symmetric memory, its waits
  bounded in device code (`gpu/exchange`, Triton) and by a host watchdog.
- `dispatch` — `EPDispatcher`: MoE dispatch/combine over a DP×EP world (exact over
  `group_comm`, padded over `peer_exchange`), and the expert placement.

Depends on torch, triton, `kernels` (the MoE reference, launch helpers) and, on GPU,
nvshmem4py or cuda-python; nothing above it.
"""
