"""The prompt groups on the policy workers' rollout streams, as the driver books them: the trainers that keep
generations across steps (the fully async rollouter with partial rollout, verl V1's colocate_async).

Each group (``rollout.n`` samples of one dataset row) lives on one inference replica's stream
(``meshrl.rollout.rollout_stream.RolloutStream``) under a key unique in the run. The driver keeps, per key, the
group's dataset row, its tag (the step that submitted it) and its replica: ``add`` books new groups and says which
keys and rows each replica gets, ``pop`` unbooks finished (or dropped) ones and gives their rows per replica.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamGroup:
    row: int  # the dataset row whose prompt the group answers
    tag: int  # the step that submitted it
    replica: int  # the inference replica whose stream holds it


class StreamGroups:
    """The booked groups by key, in the order they were added (module docstring)."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.groups: dict[int, StreamGroup] = {}
        self._next_key = 0

    def add(self, rows: list[int], tag: int,
            replicas: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Book one group per dataset row, ``replicas[i]`` holding row i's (default: consecutive equal shares, as a
        batch's rows are split over the replicas); the new keys and their rows, per replica."""
        if replicas is None:
            replicas = [position * self.replicas // len(rows) for position in range(len(rows))]
        keys: list[list[int]] = [[] for _ in range(self.replicas)]
        chosen: list[list[int]] = [[] for _ in range(self.replicas)]
        for row, replica in zip(rows, replicas, strict=True):
            self.groups[self._next_key] = StreamGroup(row, tag, replica)
            keys[replica].append(self._next_key)
            chosen[replica].append(row)
            self._next_key += 1
        return keys, chosen

    def pop(self, keys: list[list[int]]) -> list[list[int]]:
        """Unbook the groups ``keys`` (per replica); their dataset rows, per replica."""
        return [[self.groups.pop(key).row for key in replica_keys] for replica_keys in keys]

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, key: int) -> StreamGroup:
        return self.groups[key]
