"""The planner: from what the gateway saw over the last interval, the role-set counts that meet the SLOs on the
latency profile, and the role switches that move the mesh toward them. Pure: the gateway's planner task
(`services/gateway/planner.py`) and tests call it with plain snapshots.

The rule is Dynamo Planner's rate matching over TriInfer's stage loads:
  1. forecast — the next interval's arrival rate and mean request shape: an exponentially weighted mean of the
     intervals so far (`forecast`);
  2. demand — each stage's instances needed = forecast rate × instance-seconds per request at the stage's SLO
     budget (`placement.stage_seconds`), corrected by what was measured: the share of finished requests that
     missed TTFT raises the encode and prefill demand, the share that missed TBT raises the decode demand;
  3. target — the mesh's pools (its distinct role sets, which must split the stages among them: EP+D, E+P+D,
     ED+P, PD+E …) share its N workers in proportion to their stages' demand, each pool at least one and the pool
     that decodes at least the decoders the decodes under way need (their KV within γ of a cache, their batch within
     the TBT target): fewer would make the others preempt them or miss TBT;
  4. hysteresis — it switches only when the target's most loaded pool is at least `margin` less loaded than the
     current one's, and at most `max_switches` workers an interval: each from the pool with the largest surplus to
     the pool with the largest deficit, the least busy worker of it first.
With `reshape`, TriInfer's three shapes (E+P+D, EP+D, ED+P) are weighed beside the mesh's own at step 3, by the same
model, and the switches may move the mesh from one to another.
A toggle's mesh, whose one decoding pool also holds stages of the others (EP+EPD, E+P+PD, EPD+P), is planned as the
split it would be without them (`owned_stages`: EP+D, E+P+D, P+ED): the decoding pool is sized to the decodes, the
others to their stages, and what the decoders have to spare goes on prefilling, as the toggle routes it. A switch
between EP and EPD moves no prompt off a worker, only decodes. Other overlapping meshes (two pools that decode,
EP+P+EPD) are left as they are unless part-way through a reshape; one pool (EPD·N) is always left as it is.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

from common.latency.budgets import largest_within
from common.latency.model import LatencyProfile, decode_ms
from common.policy import placement
from common.request import Stage
from common.workers import WorkerInfo, WorkerLoad

STAGE_NAMES = {Stage.ENCODE: "encode", Stage.PREFILL: "prefill", Stage.DECODE: "decode"}


@dataclasses.dataclass(frozen=True, slots=True)
class PlannerConfig:
    interval_s: float = 10.0  # how often it plans
    smoothing: float = 0.5  # the newest interval's weight in the forecast
    margin: float = 0.1  # the bottleneck's load must fall by this share for a switch to be worth it
    max_switches: int = 1  # workers switched per interval
    miss_gain: float = 1.0  # demand × (1 + gain × share of requests that missed that stage's target)
    grace_s: float = 2.0  # how long a switching worker's running decodes may finish before they are handed back
    min_arrivals: int = 8  # an interval with fewer arrivals is too thin to switch on (a warm-up, a lull)
    reshape: bool = False  # weigh TriInfer's shapes (E+P+D, EP+D, ED+P) beside the mesh's own, and move between them

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or not 0 < self.smoothing <= 1 or self.margin < 0 or self.max_switches < 0:
            raise ValueError(
                "the planner needs interval_s > 0, smoothing in (0, 1], margin ≥ 0 and max_switches ≥ 0, got "
                f"{self.interval_s}, {self.smoothing}, {self.margin}, {self.max_switches}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """What the gateway saw over one interval: the requests that arrived (prompt tokens, images, max_tokens) and
    those that finished (prompt tokens, of them found in a prefix cache, output tokens, max_tokens), with how many
    of those missed TTFT, and how many met TTFT but missed TBT."""

    seconds: float
    arrivals: tuple[tuple[int, int, int], ...] = ()
    finished: tuple[tuple[int, int, int, int], ...] = ()
    ttft_missed: int = 0
    tbt_missed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Forecast:
    """The next interval's arrival rate and mean request (prompt tokens not cached, images, output tokens expected:
    the arrivals' max_tokens × the share of it finished requests used), and the shares that missed TTFT and TBT."""

    rate: float  # requests per second
    load: placement.StageLoad
    ttft_miss: float = 0.0
    tbt_miss: float = 0.0
    cached: float = 0.0  # share of prompt tokens found in a prefix cache
    used: float = 1.0  # share of max_tokens generated
    arrivals: int = 1 << 30  # in the last interval (what the rest was estimated from)


class Window:
    """What the gateway saw since the last interval, on `clock` (seconds): arrivals and finished requests with their
    SLO outcome (`common.telemetry.metrics.slo_outcome`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.arrivals: list[tuple[int, int, int]] = []
        self.finished: list[tuple[int, int, int, int]] = []
        self.ttft_missed = self.tbt_missed = 0

    def arrived(self, prompt_tokens: int, images: int, max_tokens: int) -> None:
        self.arrivals.append((prompt_tokens, images, max_tokens))

    def done(self, prompt_tokens: int, cached_tokens: int, output_tokens: int, max_tokens: int, outcome: str) -> None:
        self.finished.append((prompt_tokens, cached_tokens, output_tokens, max_tokens))
        self.ttft_missed += outcome == "ttft_violated"
        self.tbt_missed += outcome == "tbt_violated"

    def take(self) -> Interval:
        """The interval since the last `take` (or the start); the window starts again."""
        now = self.clock()
        interval = Interval(
            now - self.started, tuple(self.arrivals), tuple(self.finished), self.ttft_missed, self.tbt_missed
        )
        self.__init__(self.clock)
        return interval


@dataclasses.dataclass(frozen=True, slots=True)
class PoolWorker:
    worker_id: str
    roles: frozenset[Stage]
    busy: float = 0.0  # what switching it now would disturb (e.g. its unfinished decode tokens)
    kv_tokens: int = 0  # tokens its KV cache holds
    decoding: int = 0  # requests it is decoding now
    context_tokens: int = 0  # their KV tokens

    @classmethod
    def of(cls, info: WorkerInfo, load: WorkerLoad) -> PoolWorker:
        """A registered worker as its last heartbeat reported it."""
        return cls(
            info.worker_id,
            info.roles,
            load.unfinished_decode_tokens + load.queued_prefill_tokens,
            load.kv_blocks_total * load.kv_block_size,
            load.running_decode_batch,
            load.decode_context_tokens,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Switch:
    worker_id: str
    before: frozenset[Stage]
    after: frozenset[Stage]


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "switch", "hold", "idle" (nothing to forecast from yet), "fixed" (a shape it does not plan)
    reason: str
    demand: dict[str, float] = dataclasses.field(default_factory=dict)  # instances each stage needs
    current: dict[str, int] = dataclasses.field(default_factory=dict)  # pool (role label) → workers
    target: dict[str, int] = dataclasses.field(default_factory=dict)
    switches: tuple[Switch, ...] = ()

    def as_dict(self) -> dict:
        return {
            "action": self.action,
            "reason": self.reason,
            "demand": {k: round(v, 3) for k, v in self.demand.items()},
            "current": self.current,
            "target": self.target,
            "switches": [
                {"worker_id": s.worker_id, "from": label(s.before), "to": label(s.after)} for s in self.switches
            ],
        }


class Planner:
    """The planner from one interval to the next (its forecast): what the gateway's task and the simulator step."""

    def __init__(self, profile: LatencyProfile, ttft_ms: float, tbt_ms: float, config: PlannerConfig = PlannerConfig()):
        self.profile, self.ttft_ms, self.tbt_ms, self.config = profile, ttft_ms, tbt_ms, config
        self.forecast: Forecast | None = None

    def step(self, interval: Interval, workers: list[PoolWorker] | None) -> Decision:
        """The decision after `interval`; `workers`: the registry's, None while a switch is under way (it holds)."""
        self.forecast = forecast(self.forecast, interval, self.config.smoothing)
        if workers is None:
            return Decision("hold", "a switch is under way")
        return decide(workers, self.forecast, self.profile, self.ttft_ms, self.tbt_ms, self.config)


def label(roles: frozenset[Stage]) -> str:
    return "".join(s.name[0] for s in sorted(roles))


def forecast(previous: Forecast | None, interval: Interval, smoothing: float) -> Forecast | None:
    """The forecast after one more interval: the request shape from this interval's arrivals, corrected by what
    the finished ones showed (cache hits, outputs shorter than max_tokens), mixed with the previous forecast
    (weight `smoothing` on the new). None while nothing has arrived yet."""
    rate = len(interval.arrivals) / interval.seconds if interval.seconds > 0 else 0.0
    finished = interval.finished
    prompts = sum(f[0] for f in finished)
    allowed = sum(f[3] for f in finished)
    fallback = previous or Forecast(0.0, placement.StageLoad(0, 0, 0, 0))
    cached = sum(f[1] for f in finished) / prompts if prompts else fallback.cached
    used = sum(f[2] for f in finished) / allowed if allowed else fallback.used
    ttft_miss = interval.ttft_missed / len(finished) if finished else fallback.ttft_miss
    tbt_miss = interval.tbt_missed / len(finished) if finished else fallback.tbt_miss
    if interval.arrivals:
        load = placement.StageLoad.of([(p * (1 - cached), i, m * used) for p, i, m in interval.arrivals])
    elif previous is not None:
        load = previous.load
    else:
        return None
    new = Forecast(rate, load, ttft_miss, tbt_miss, cached, used, len(interval.arrivals))
    if previous is None:
        return new
    w = smoothing

    def mix(a, b):
        if isinstance(a, placement.StageLoad):
            return placement.StageLoad(*(mix(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)))
        return w * a + (1 - w) * b

    mixed = [mix(getattr(new, f.name), getattr(previous, f.name)) for f in dataclasses.fields(new)][:-1]
    return Forecast(*mixed, len(interval.arrivals))


def stage_demand(
    f: Forecast, profile: LatencyProfile, ttft_ms: float, tbt_ms: float, kv_tokens: int, miss_gain: float
) -> dict[str, float]:
    """Instances each stage needs at the forecast (step 2 of the module docstring)."""
    seconds = placement.stage_seconds(profile, f.load, ttft_ms, tbt_ms, kv_tokens)
    first = 1 + miss_gain * f.ttft_miss
    return {
        "encode": f.rate * seconds["encode"] * first,
        "prefill": f.rate * seconds["prefill"] * first,
        "decode": f.rate * seconds["decode"] * (1 + miss_gain * f.tbt_miss),
    }


def decide(
    workers: list[PoolWorker],
    f: Forecast | None,
    profile: LatencyProfile,
    ttft_ms: float,
    tbt_ms: float,
    config: PlannerConfig = PlannerConfig(),
) -> Decision:
    """The decision for the mesh of `workers` at the forecast `f` (module docstring)."""
    pools = sorted({w.roles for w in workers}, key=label)
    current = {label(p): sum(w.roles == p for w in workers) for p in pools}
    if len(pools) < 2:  # (its load model does not price colocation's interference: colocated stays so)
        return Decision("fixed", "one role set: nothing to rebalance", current=current)
    own = [pools] if owned_stages(pools) else []  # (a mesh part-way through a reshape does not)
    if not own and not config.reshape:
        return Decision("fixed", "its role sets do not split the stages among them", current=current)
    if f is None or f.rate <= 0 or f.arrivals < config.min_arrivals:
        return Decision("idle", "too few arrivals to plan from", current=current)
    decoders = [w.kv_tokens for w in workers if Stage.DECODE in w.roles and w.kv_tokens]
    kv_tokens = min(decoders, default=1 << 20)
    demand = stage_demand(f, profile, ttft_ms, tbt_ms, kv_tokens, config.miss_gain)
    held = held_decoders(workers, profile, tbt_ms, kv_tokens)
    shapes = own + ([s for s in SHAPES if s != pools and len(s) <= len(workers)] if config.reshape else [])
    scored = []
    for i, shape in enumerate(shapes):
        floors = [held if Stage.DECODE in p else 1 for p in shape]
        planned = owned_stages(shape)
        counts = placement.apportion(len(workers), _needs(planned, demand), floors)
        scored.append((bottleneck(dict(zip(planned, counts)), demand), i, shape, counts))
    then, _, shape, counts = min(scored)  # (ties: the mesh's own shape first)
    target = {label(p): n for p, n in zip(shape, counts) if n}
    if target == current:
        return Decision("hold", "the pools match the forecast", demand, current, target)
    now = bottleneck({p: current[label(q)] for p, q in zip(owned_stages(pools) or pools, pools)}, demand)
    if then > (1 - config.margin) * now:
        return Decision(
            "hold", f"the bottleneck's load would go from {now:.2f} to {then:.2f} only", demand, current, target
        )
    switches = _moves(workers, dict(zip(shape, counts)), config.max_switches)
    return Decision(
        "switch" if switches else "hold",
        f"the bottleneck's load goes from {now:.2f} to {then:.2f} (instances of work per instance)",
        demand,
        current,
        target,
        tuple(switches),
    )


# the shapes `reshape` weighs beside the mesh's own: TriInfer's three (E+P+D, and EP+D and ED+P derived from it)
SHAPES = [
    [frozenset({Stage.ENCODE}), frozenset({Stage.PREFILL}), frozenset({Stage.DECODE})],
    [frozenset({Stage.ENCODE, Stage.PREFILL}), frozenset({Stage.DECODE})],
    [frozenset({Stage.ENCODE, Stage.DECODE}), frozenset({Stage.PREFILL})],
]


def splits(pools: list[frozenset[Stage]]) -> bool:
    """The role sets share no stage and together hold every one."""
    disjoint = not any(a & b for i, a in enumerate(pools) for b in pools[i + 1 :])
    return disjoint and frozenset().union(*pools) == frozenset(Stage)


def owned_stages(pools: list[frozenset[Stage]]) -> list[frozenset[Stage]] | None:
    """The stages each pool is planned for, in the order of `pools`: a split's own role sets; for a toggle's mesh
    (one pool decodes, the others share no stage and do not decode) the others' role sets and, for the decoding
    pool, decode and what no other pool holds (EP+EPD → EP+D, EPD+P → ED+P, E+P+PD → E+P+D). None: a mesh the
    planner does not plan (two pools that decode, prefilling pools that overlap, a stage no pool holds)."""
    if splits(pools):
        return list(pools)
    decoding = [p for p in pools if Stage.DECODE in p]
    if len(pools) < 2 or len(decoding) != 1:
        return None
    others = frozenset().union(*(p for p in pools if p != decoding[0]))
    planned = [p if p != decoding[0] else p - others for p in pools]
    return planned if splits(planned) else None


def _needs(pools: list[frozenset[Stage]], demand: dict[str, float]) -> list[float]:
    return [sum(demand[STAGE_NAMES[s]] for s in p) for p in pools]


def bottleneck(mesh: dict[frozenset[Stage], int], demand: dict[str, float]) -> float:
    """The most loaded worker's load (instances of work per instance) in a mesh of these role sets and counts, each
    stage's demand shared by the workers that hold it."""
    holders = {s: sum(n for roles, n in mesh.items() if s in roles) for s in Stage}
    return max(sum(demand[STAGE_NAMES[s]] / holders[s] for s in roles) for roles, n in mesh.items() if n)


def held_decoders(workers: list[PoolWorker], profile: LatencyProfile, tbt_ms: float, kv_tokens: int) -> int:
    """Decoders the decodes under way need: their KV within γ of a decoder's cache, their batch within the TBT
    target — a plan that leaves fewer would hand them to decoders that must preempt them or miss TBT."""
    running = sum(w.decoding for w in workers if Stage.DECODE in w.roles)
    if not running:
        return 1
    held = sum(w.context_tokens for w in workers if Stage.DECODE in w.roles)
    context = max(held / running, 1.0)
    batch = largest_within(lambda b: decode_ms(profile, b, round(b * context)), tbt_ms, 1 << 14) or 1
    return max(math.ceil(held / (placement.KV_FRACTION * kv_tokens)), math.ceil(running / batch), 1)


def _moves(workers: list[PoolWorker], target: dict[frozenset[Stage], int], budget: int) -> list[Switch]:
    """Up to `budget` switches toward `target`, all under way at once: each takes a worker (the least busy) from a
    role set with a surplus (the largest first) to one with a deficit — a role set the mesh has none of first, then
    the largest deficit — as long as the workers not switching still hold every stage (a switching worker is out of
    the registry until it is done)."""
    counts = collections.Counter(w.roles for w in workers)
    moves, moved = [], set()
    while len(moves) < budget:
        sets = sorted(set(counts) | set(target), key=label)
        surplus = {p: counts[p] - target.get(p, 0) for p in sets}
        donors = sorted((p for p in sets if surplus[p] > 0), key=lambda p: -surplus[p])
        recipients = sorted((p for p in sets if surplus[p] < 0), key=lambda p: (counts[p] > 0, surplus[p]))
        move = next(
            (
                (worker, donor, recipient)
                for donor in donors
                for recipient in recipients
                for worker in sorted(
                    (w for w in workers if w.roles == donor and w.worker_id not in moved),
                    key=lambda w: (w.busy, w.worker_id),
                )
                if _covered([w for w in workers if w.worker_id not in moved and w is not worker])
            ),
            None,
        )
        if move is None:
            break
        worker, donor, recipient = move
        moves.append(Switch(worker.worker_id, donor, recipient))
        moved.add(worker.worker_id)
        counts[donor] -= 1
        counts[recipient] += 1
    return moves


def _covered(workers: list[PoolWorker]) -> bool:
    return frozenset().union(*(w.roles for w in workers)) == frozenset(Stage)
