"""A root's verdict from reopening warmed files: one cold look is not enough (reopen.py)."""

from __future__ import annotations

from kvprefetchd.channel import Verdict
from kvprefetchd.worker.reopen import RECHECK_SECONDS, STRIKES, Verdicts


def test_a_root_is_dropped_after_strikes_in_a_row_and_kept_at_the_first_warm_look() -> None:
    now = [0.0]
    verdicts = Verdicts(lambda: now[0])
    for _ in range(STRIKES - 1):
        verdicts.looked(0, False)
    assert not verdicts.dropped(0) and verdicts.wants_look(0)
    verdicts.looked(0, True)  # a warm look resets the strikes
    verdicts.looked(0, False)
    assert not verdicts.dropped(0)
    verdicts.looked(0, False)
    assert verdicts.dropped(0)
    assert verdicts.take_changed() == [Verdict(0, "kept"), Verdict(0, "dropped")]
    assert not verdicts.wants_look(0)
    now[0] += RECHECK_SECONDS
    assert verdicts.wants_look(0)  # looked at anew: a remount may have changed it
    verdicts.forget(0)
    assert not verdicts.dropped(0)
