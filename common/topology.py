"""Topology strings: `EPD1` (colocated), `E1+P1+D1`, `EP1+D2`, `ED1+P1`, `E2+P2+D4`, `E1+P1+PD1`.

Each `+`-separated group is a role set (letters E, P, D, any order) and how many workers hold it.
"""

from __future__ import annotations

import dataclasses
import re

from common.request import Stage

_GROUP = re.compile(r"^([EPDepd]+)(\d+)$")
_LETTERS = {"E": Stage.ENCODE, "P": Stage.PREFILL, "D": Stage.DECODE}


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerGroup:
    roles: frozenset[Stage]
    count: int

    @property
    def label(self) -> str:
        return "".join(s.name[0] for s in sorted(self.roles))


def parse_topology(text: str) -> list[WorkerGroup]:
    groups = []
    for part in text.replace(" ", "").split("+"):
        m = _GROUP.match(part)
        if not m:
            raise ValueError(f"bad topology group {part!r} in {text!r}; write role letters then a count, e.g. E1+P1+D1")
        letters = m.group(1).upper()
        if len(set(letters)) != len(letters):
            raise ValueError(f"repeated role letter in {part!r}")
        count = int(m.group(2))
        if count < 1:
            raise ValueError(f"group {part!r} needs at least one worker")
        groups.append(WorkerGroup(frozenset(_LETTERS[c] for c in letters), count))
    roles = set().union(*(g.roles for g in groups))
    missing = [s.name.lower() for s in Stage if s not in roles]
    if missing:
        raise ValueError(f"topology {text!r} has no worker for {missing}")
    return groups


def decoders_join(groups: list[WorkerGroup]) -> bool:
    """Whether decoders that prefill also take requests handed over by dedicated prefill workers (`E1+P1+PD1`):
    then such a decoder's iterations must fit TBT twice (a joining request waits for the one in flight)."""
    handoffs = any(Stage.PREFILL in g.roles and Stage.DECODE not in g.roles for g in groups)
    return handoffs and any({Stage.PREFILL, Stage.DECODE} <= g.roles for g in groups)
