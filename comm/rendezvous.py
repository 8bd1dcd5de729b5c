"""`held_address` / `rendezvous_store`: the TCP store a new epoch's ranks meet at.

Picking a free port and binding it later leaves a window in which another socket can
take it (seen in CI: EADDRINUSE while a group re-formed, which cost the formation an
epoch). So rank 0's process binds its store first (`held_address`: port 0, the kernel
picks) and hands the address out; when that process joins the group it uses the store
it already holds. Invariant: a held store's port is bound from the moment its address
exists until the group that uses it is destroyed.

Every rank of a ``tcp://`` address builds its own store here (rank 0: the held one, or a
new server at that port for callers that picked the port themselves; the others:
clients), so all ranks see the same keys. Other init methods (``file://``) go to torch.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Optional
from urllib.parse import urlparse

import torch.distributed as dist

__all__ = ["held_address", "rendezvous_store"]

_held: dict[str, dist.TCPStore] = {}  # address -> bound server store, until rank 0 takes it
_lock = threading.Lock()


def held_address(host: str, timeout_s: float = 60.0) -> str:
    """A ``tcp://host:port`` whose store server is bound now, in this process."""
    store = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    address = f"tcp://{f'[{host}]' if ':' in host else host}:{store.port}"
    with _lock:
        _held[address] = store
    return address


def rendezvous_store(init_method: str, rank: int,
                     timeout: timedelta) -> Optional[dist.TCPStore]:
    """The store `rank` joins ``init_method``'s group through, or None for an init method
    torch resolves itself (not ``tcp://``). Raises what `TCPStore` raises (a port taken,
    a server not reached within `timeout`)."""
    url = urlparse(init_method)
    if url.scheme != "tcp":
        return None
    if url.hostname is None or url.port is None:
        raise ValueError(f"rendezvous address needs a host and a port: {init_method!r}")
    if rank == 0:
        with _lock:
            store = _held.pop(init_method, None)
        if store is not None:
            store.set_timeout(timeout)
            return store
    return dist.TCPStore(url.hostname, url.port, None, rank == 0, timeout,
                         wait_for_workers=False)
