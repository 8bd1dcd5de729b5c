"""How much device memory a rank's KV staging buffers may take, so that the KV pool is
sized without it (pure arithmetic; no torch).

A connection that carries a staged message (re-cut heads, scattered pages) holds
`STAGING_BUFFERS` buffers of the receiver's largest message on each side, made at its
first staged message and kept while it lives; a connection whose KV lands in place
holds none. A prefill rank connects to every decode rank it streams to (at most the
decode group's `dp × tp`), a decode rank accepts one connection from every prefill rank
(`prefill_tp × prefill_instances`). Reserving the worst case at start trades that much
KV capacity for never running out of device memory in the middle of a transfer.
"""

from __future__ import annotations

__all__ = ["CPU_MESSAGE_BYTES", "GPU_MESSAGE_BYTES", "STAGING_BUFFERS", "message_bytes",
           "staging_bytes"]

# Largest staged message a receiver takes. On GPU a staged message costs ~0.3-0.5 ms of
# host per side and the wire ~0.82 ms per 256 MiB (2×H200): 32k tokens, scattered pages,
# best of 5: 128 MiB 0.44-0.53 of raw, 256 MiB 0.61-0.70 (bench/NOTES.md v9).
CPU_MESSAGE_BYTES = 32 << 20
GPU_MESSAGE_BYTES = 256 << 20
STAGING_BUFFERS = 3  # staged messages in flight per connection and side


def message_bytes(device: str) -> int:
    """The largest staged message on `device` ('cpu', 'cuda' or 'cuda:N')."""
    return CPU_MESSAGE_BYTES if device == "cpu" else GPU_MESSAGE_BYTES


def staging_bytes(connections: int, device: str) -> int:
    """Staging memory of a rank holding `connections` connections, every one staged."""
    if connections < 0:
        raise ValueError(f"connections must be >= 0, got {connections}")
    return connections * STAGING_BUFFERS * message_bytes(device)
