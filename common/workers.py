"""What the registry knows about a worker (no torch; the routing policy reads these)."""

from __future__ import annotations

import dataclasses

from common.request import Stage

HEARTBEAT_INTERVAL_S = 0.5  # a worker reports its load this often (the toggle may ask for another interval)


def registration(worker_id: str, instance: str) -> str:
    return f"{worker_id}#{instance}" if instance else worker_id


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    address: str  # host:port of its gRPC server
    roles: frozenset[Stage]
    model: str = ""
    max_model_len: int = 0
    transfer_backend: str = "grpc"
    pid: int = 0
    metrics_port: int = 0
    instance: str = ""  # new at every start of the process: a worker restarted under the same id is another one
    prefix_caching: bool = False  # it keeps prompts' KV for later requests: cache-aware routing predicts hits only here
    # the stage budgets its scheduler runs (what the SLO policy predicts its iterations from); 0: not reported
    token_budget: int = 0  # τ_t: tokens per iteration
    image_budget: int = 0  # τ_e: images per iteration
    join_first: bool = False  # a handed-over request's first decode gets a decode-only iteration here

    def __post_init__(self) -> None:
        if not self.worker_id or not self.address:
            raise ValueError("a worker needs an id and an address")
        if not self.roles:
            raise ValueError(f"worker {self.worker_id} has no roles")

    @property
    def registration(self) -> str:
        """What a request that this worker failed routes around: this run of it, not a restart under the same id
        (a fixed --worker-id, or a fixed port, in docker compose)."""
        return registration(self.worker_id, self.instance)

    @property
    def role_label(self) -> str:
        return "".join(s.name[0] for s in sorted(self.roles))


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_waiting: int = 0
    num_running: int = 0
    running_decode_batch: int = 0
    unfinished_decode_tokens: int = 0
    last_iteration_ms: float = 0.0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    image_blocks_free: int = 0
    image_blocks_total: int = 0
    num_leases: int = 0
    iterations: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens waiting or still to prefill here
    queued_images: int = 0  # images waiting or still to encode here
    decode_context_tokens: int = 0  # KV tokens of the running decodes (what one decode iteration reads)
    kv_tokens_free: int = 0  # tokens the free KV blocks hold
    iteration_elapsed_ms: float = 0.0  # how long the iteration under way had run when this was taken (0: none)
    num_preemptions: int = 0  # since start: running requests whose KV was freed for others (recomputed or handed back)
    kv_block_size: int = 0  # tokens per KV block (0: not reported)
    long_token_budget: int = 0  # τ_t of its next iteration, run long while its decodes spare a slow gap (0: none)

    @property
    def queue_length(self) -> int:
        return self.num_waiting + self.num_running

    @property
    def kv_tokens_total(self) -> int:
        """Tokens its whole KV cache holds (0: unknown — a worker that reports no block size and has no free block
        to tell it by)."""
        if self.kv_block_size:
            return self.kv_blocks_total * self.kv_block_size
        return self.kv_blocks_total * (self.kv_tokens_free // self.kv_blocks_free) if self.kv_blocks_free else 0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    info: WorkerInfo
    load: WorkerLoad
    age_s: float = 0.0  # since its last heartbeat

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def has(self, stage: Stage) -> bool:
        return stage in self.info.roles

    def excluded_by(self, exclude: frozenset[str]) -> bool:
        """`exclude` names it: by this registration (it failed the request) or by id (no KV room there)."""
        return self.worker_id in exclude or self.info.registration in exclude


def registered_budgets(scheduling) -> dict:
    """The stage budgets a worker registers (`WorkerInfo`) from its scheduler's configuration
    (`common.scheduler.SchedulerConfig`): what it runs, which the SLO-aware router predicts its iterations from."""
    return dict(
        token_budget=scheduling.token_budget, image_budget=scheduling.image_budget, join_first=scheduling.join_first
    )


def load_of(
    stats, block_size: int, last_iteration_ms: float, iterations: int, iteration_elapsed_ms: float, num_leases: int = 0
) -> WorkerLoad:
    """The load a worker reports from its engine's statistics (`common.engine.outputs.EngineStats`) and its
    iterations: the last one's length, how many so far, how long the one under way has run (0: none)."""
    return WorkerLoad(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        running_decode_batch=stats.running_decodes,
        unfinished_decode_tokens=stats.unfinished_decode_tokens,
        last_iteration_ms=last_iteration_ms,
        kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_total=stats.kv_blocks_total,
        image_blocks_free=stats.image_blocks_free,
        image_blocks_total=stats.image_blocks_total,
        num_leases=num_leases,
        iterations=iterations,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        queued_images=stats.queued_images,
        decode_context_tokens=stats.decode_context_tokens,
        kv_tokens_free=stats.kv_blocks_free * block_size,
        kv_block_size=block_size,
        iteration_elapsed_ms=iteration_elapsed_ms,
        num_preemptions=stats.num_preemptions,
        long_token_budget=stats.long_token_budget,
    )
