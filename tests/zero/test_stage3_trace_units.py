"""The recorded order of stage-3 gather requests (`FetchTrace`) in process: what it records, how later
micro-steps follow it, and the next use and reuse distance it answers (DeepSpeed's stage3_max_reuse_distance:
parameter elements requested from now until the next use)."""
from __future__ import annotations

from zerotrain.zero.stage3.trace import FetchTrace


def test_record_follow_and_reuse_distances():
    trace = FetchTrace()
    assert trace.recording and not trace.usable
    requests = [((1, 2), "forward", 10), ((3,), "forward", 5), ((1, 2), "backward", 10), ((4,), "backward", 7)]
    for key, reason, numel in requests:
        trace.follow(key, reason, numel)
    assert trace.cursor == 0 and trace.mismatches == 0, "recording moves no cursor"
    trace.end_micro_step()
    assert trace.entries == [(1, 2), (3,), (1, 2), (4,)] and trace.reasons == ["forward", "forward", "backward",
                                                                               "backward"]
    assert not trace.recording
    trace.begin_micro_step()
    assert trace.usable
    # at the start: 1 and 2 are requested right now, 3 after 10 elements, 4 after 10 + 5 + 10
    assert [trace.next_use(p) for p in (1, 2, 3, 4, 99)] == [0, 0, 1, 3, None]
    assert [trace.reuse_distance(p) for p in (1, 3, 4, 99)] == [0, 10, 25, None]
    trace.follow((1, 2), "forward", 10)
    assert trace.cursor == 1
    assert trace.next_use(1) == 2 and trace.reuse_distance(1) == 5 and trace.reuse_distance(4) == 15
    assert trace.next_use(1, start=2) == 2 and trace.next_use(1, start=3) is None and trace.next_use(3, 0) == 1
    trace.follow((3,), "forward", 5)
    trace.follow((9,), "forward", 1)  # off the record: prefetch and reuse stop relying on it
    assert not trace.usable and trace.cursor == 2 and trace.mismatches == 1
    trace.follow((1, 2), "backward", 10)  # the same micro-step's later requests count no second mismatch
    assert trace.cursor == 2 and trace.mismatches == 1
    trace.end_micro_step()  # a later micro-step's end indexes nothing again
    trace.begin_micro_step()
    assert trace.usable and trace.cursor == 0 and trace.reuse_distance(4) == 25
    for key, reason, numel in requests:
        trace.follow(key, reason, numel)
    assert trace.usable and trace.cursor == 4 and trace.reuse_distance(1) is None
    trace.follow((1, 2), "forward", 10)  # past the record's end
    assert not trace.usable and trace.mismatches == 2
