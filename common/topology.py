"""Topology strings: `EPD1` (colocated), `E1+P1+D1`, `EP1+D2`, `ED1+P1`, `E2+P2+D4`, `E1+P1+PD1`.

Each `+`-separated group is a role set (letters E, P, D, any order) and how many workers hold it.
"""

from __future__ import annotations

import dataclasses
import itertools
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


def hands_over(groups: list[WorkerGroup]) -> bool:
    """Whether some workers prefill without decoding: they hand their requests over to a decoder (path ①)."""
    return any(Stage.PREFILL in g.roles and Stage.DECODE not in g.roles for g in groups)


def decoders_join(groups: list[WorkerGroup]) -> bool:
    """Whether decoders that prefill also take requests handed over by dedicated prefill workers (`E1+P1+PD1`):
    then such a decoder's iterations must fit TBT twice (a joining request waits for the one in flight)."""
    return hands_over(groups) and any({Stage.PREFILL, Stage.DECODE} <= g.roles for g in groups)


# the role sets a worker can hold, in the order a deployment names them (E1+P1+D1, EP4+EPD4, ED2+P1)
ROLE_SETS = ("E", "EP", "ED", "EPD", "P", "PD", "D")
# each stage on exactly one pool: the ways to split {E, P, D} into role sets
_POOLS = (("EPD",), ("E", "PD"), ("P", "ED"), ("EP", "D"), ("E", "P", "D"))
SPACES = {
    "pools": "each stage on exactly one pool of workers: EPD·N, E+PD, ED+P, EP+D and E+P+D splits (TriInfer's three "
    "workflows, colocation and E+PD)",
    "pairs": "the pools, and every deployment of two role sets that together hold every stage (e.g. EP4+EPD4)",
    "all": "every deployment of N workers over the seven role sets that holds every stage",
}


def deployments(n: int, space: str = "all") -> list[str]:
    """The topologies of `n` workers in `space` (see SPACES), each once, in a fixed order."""
    if n < 1:
        raise ValueError("a deployment needs at least one worker")
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; one of {', '.join(SPACES)}")
    if space == "pools":
        kinds_of = _POOLS
    else:
        sizes = (1, 2) if space == "pairs" else range(1, len(ROLE_SETS) + 1)
        kinds_of = [
            kinds
            for size in sizes
            for kinds in itertools.combinations(ROLE_SETS, size)
            if set("".join(kinds)) == set("EPD")
        ]
        if space == "pairs":
            kinds_of = [*kinds_of, ("E", "P", "D")]
    out = []
    for kinds in kinds_of:
        for counts in _compositions(n, len(kinds)):
            named = sorted(zip(kinds, counts), key=lambda kc: ROLE_SETS.index(kc[0]))
            out.append("+".join(f"{kind}{count}" for kind, count in named))
    return out


def _compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of `parts` positive counts."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))
