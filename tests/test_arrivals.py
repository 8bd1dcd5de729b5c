"""Arrival counters (kernels/gpu/arrivals.py): zeroed, per user and lane, grown on demand
without freeing a buffer a captured graph may still count in."""

from __future__ import annotations

import torch

from phalanx.kernels.gpu import arrivals


def test_counters_are_zeroed_per_user_and_lane_and_outgrown_buffers_stay_alive():
    user = "test_arrivals"
    a = arrivals.arrival_counts(user, 10, torch.device("cpu"))
    assert a.numel() >= 4096 and int(a.abs().sum()) == 0
    assert arrivals.arrival_counts(user, 4096, torch.device("cpu")) is a  # fits: the same
    with arrivals.lane_scope(1):
        assert arrivals.arrival_counts(user, 10, torch.device("cpu")) is not a
    a[3] = 1  # a count left behind in the old buffer is still seen
    bigger = arrivals.arrival_counts(user, 5000, torch.device("cpu"))
    assert bigger is not a and bigger.numel() >= 5000
    assert any(t is a for t in arrivals._outgrown)  # kept: a graph may point at it
    assert not arrivals.all_zero()
    a[3] = 0
    assert arrivals.all_zero()
