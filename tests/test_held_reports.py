"""`HeldReports` (actors/held_reports.py): when a client asks a leader for every held
hash and when only for evictions, and what it hands the router."""

from phalanx.actors.held_reports import HeldReports


def test_full_first_then_incremental_then_full_every_n_rounds():
    reports = HeldReports(full_every=3)
    asked = []
    for round_ in range(7):
        reports.next_round()
        since = reports.since("g", epoch=1)
        asked.append(since)
        reply = {"seq": 10 * (round_ + 1), "full": [1, 2]} if since < 0 else \
            {"seq": 10 * (round_ + 1), "evicted": [round_]}
        out = reports.take("g", 1, reply)
        assert out == ([1, 2] if since < 0 else {"evicted": [round_]})
    # round 1 full, then the last answer's count, a full list every third round
    assert asked == [-1, 10, 20, -1, 40, 50, -1]


def test_a_new_epoch_or_leader_starts_with_a_full_list():
    reports = HeldReports()
    reports.next_round()
    reports.take("g", 1, {"seq": 5, "full": []})
    reports.next_round()
    assert reports.since("g", 1) == 5
    assert reports.since("g", 2) == -1  # the group was re-formed
    assert reports.since("other", 1) == -1
