"""``meshrl.trainer.stream_groups``: the driver's book of the prompt groups on the replicas' rollout streams."""

from meshrl.trainer.stream_groups import StreamGroups


def test_groups_split_in_consecutive_shares_or_where_asked_and_pop_gives_their_rows_back():
    streams = StreamGroups(replicas=2)
    keys, rows = streams.add([10, 11, 12, 13], tag=1)
    assert keys == [[0, 1], [2, 3]] and rows == [[10, 11], [12, 13]]  # as a batch's rows are split
    more, more_rows = streams.add([20, 21], tag=2, replicas=[1, 1])  # refills for the replica that dropped two
    assert more == [[], [4, 5]] and more_rows == [[], [20, 21]]
    assert len(streams) == 6 and streams[4].tag == 2 and streams[4].replica == 1 and streams[0].row == 10
    assert streams.pop([[1], [5, 2]]) == [[11], [21, 12]]  # in the order of the keys asked
    assert list(streams.groups) == [0, 3, 4] and len(streams) == 3
    again, _ = streams.add([30], tag=3)
    assert again == [[6], []]  # keys are never reused
