"""The rendezvous store (`comm.rendezvous`): a held address's port is bound before anyone
joins, rank 0 joins through the store it holds, and a world forms through it."""

from __future__ import annotations

import errno
import os
import socket
import time
from datetime import timedelta

import pytest

from phalanx.comm.rendezvous import held_address, rendezvous_store
from phalanx.spawn import run_ranks

TIMEOUT = timedelta(seconds=10)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_held_address_is_bound_and_rank_0_gets_its_store():
    address = held_address("127.0.0.1")
    with socket.socket() as s, pytest.raises(OSError) as taken:
        s.bind(("127.0.0.1", _port(address)))
    assert taken.value.errno == errno.EADDRINUSE
    server = rendezvous_store(address, 0, TIMEOUT)
    client = rendezvous_store(address, 1, TIMEOUT)
    client.set("k", "from rank 1")
    assert server.get("k") == b"from rank 1"
    # Taken once: a second rank 0 of the same address would start its own server there.
    with pytest.raises(Exception, match="(?i)address already in use|EADDRINUSE"):
        rendezvous_store(address, 0, TIMEOUT)


def test_other_init_methods_go_to_torch_and_bad_addresses_are_refused(tmp_path):
    assert rendezvous_store(f"file://{tmp_path}/rdv", 0, TIMEOUT) is None
    with pytest.raises(ValueError, match="host and a port"):
        rendezvous_store("tcp://127.0.0.1", 1, TIMEOUT)


def _join(rank: int, world: int, path: str) -> list[int]:
    from phalanx.comm.group_comm import GroupComm
    if rank == 0:
        address = held_address("127.0.0.1")
        time.sleep(1.0)  # the port stays ours while the others are still on their way
        with open(path + ".tmp", "w") as f:
            f.write(address)
        os.replace(path + ".tmp", path)
    else:
        while not os.path.exists(path):
            time.sleep(0.05)
        address = open(path).read()
    comm = GroupComm.init(rank, world, 1, address, 4, 20.0)
    try:
        return comm.all_reduce_world_max(rank, 10 * (rank + 1))
    finally:
        comm.destroy()


def test_a_world_forms_through_a_held_address(tmp_path):
    results, errors = run_ranks(_join, 3, (str(tmp_path / "address"),), timeout_s=60,
                                torch_threads=1)
    assert not errors, errors
    assert results == {r: [2, 30] for r in range(3)}
