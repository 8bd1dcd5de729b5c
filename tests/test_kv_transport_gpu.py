"""The KV transport with CUDA pools (GPU machine only; CPU runs of the same scenarios are
in `test_kv_transport`): announced messages' receives posted into device memory, and
withdrawn ones completed by empty messages, over ucxx's CUDA transports."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from kv_actors import UCX_ENV, Actor
from kv_announce import announce_lives, check_lives

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_announced_messages_on_cuda_pools():
    """As `test_announced_messages_land_withdraw_expire_and_are_bounded`, pools on GPU 0."""
    actor = Actor(mp.get_context("spawn"),
                  {**UCX_ENV, "UCX_TLS": "cuda_copy,cuda_ipc,tcp,sm,self"})
    try:
        check_lives(actor.call(announce_lives, timeout_s=2.0, device="cuda"))
    finally:
        actor.stop()
