"""One simulated worker: the emulated engine a real worker runs (`common/engine/emulated.py`: the scheduler with its
budgets, the block pools, KV admission and preemption, the prefix cache, page hand-over), its iterations timed by
the latency profile on simulated time instead of slept, and the load it reports in its heartbeats.

An iteration is planned when it starts and its results land when it ends, as on a real worker: work that arrives
meanwhile waits for the next one, and a heartbeat sent meanwhile reports the iteration under way."""

from __future__ import annotations

from collections.abc import Callable

from common.engine.emulated import EmulatedEngine
from common.engine.outputs import RequestOutput
from common.request import Request
from common.workers import WorkerInfo, WorkerLoad, load_of
from sim.events import Loop


class SimWorker:
    def __init__(
        self,
        loop: Loop,
        info: WorkerInfo,
        engine: EmulatedEngine,
        deliver: Callable[[SimWorker, list[RequestOutput]], None],
    ):
        """`deliver(worker, outputs)`: what each iteration gave, at its end (and requests handed back, at once)."""
        self.loop, self.info, self.engine, self.deliver = loop, info, engine, deliver
        engine.sleeps = False  # simulated time: the loop advances by the prediction instead
        engine.clock = lambda: loop.now  # its requests arrive on it too (`sim/mesh.py`)
        self.away = False  # out of the registry (switching roles): routers do not choose it, stage calls are refused
        self.between: Callable[[], None] | None = None  # run once when no iteration is under way (a switch's hand-back)
        self.started: float | None = None  # when the iteration under way started
        self.last_iteration_ms = 0.0
        self.iterations = 0
        self.busy_s = 0.0  # simulated seconds spent in iterations

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def add(self, request: Request, preloaded: bool = False) -> None:
        self.engine.add_request(request, preloaded=preloaded)
        self.kick()

    def kick(self) -> None:
        """Start an iteration if none is under way and there is work (called whenever work or room arrives)."""
        if self.started is None and self.between is not None:
            between, self.between = self.between, None
            between()
        if self.started is None and self.engine.has_unfinished:
            self._begin()

    def reconfigure(self, config) -> None:
        """The idle engine takes a new role set's configuration (`Engine.reconfigure`), on simulated time still."""
        self.engine.reconfigure(config)
        self.engine.sleeps = False
        self.engine.clock = lambda: self.loop.now

    def _begin(self) -> None:
        plan, handed_back = self.engine.begin_step()
        if plan is not None:  # (else nothing can run now, no KV room: a new request or freed pages kick it again)
            sampling, tokens = self.engine.execute_step(plan)
            ms = self.engine.predicted_ms
            self.started = self.loop.now
            self.loop.after(ms / 1e3, self._end, plan, sampling, tokens, ms)
        if handed_back:  # after the step is under way: what their routes send here waits for the next one
            self.deliver(self, handed_back)

    def _end(self, plan, sampling, tokens, ms: float) -> None:
        outputs = self.engine.end_step(plan, sampling, tokens, ms)
        self.started = None
        self.last_iteration_ms = ms
        self.iterations += 1
        self.busy_s += ms / 1e3
        if outputs:
            self.deliver(self, outputs)
        self.kick()

    def load(self) -> WorkerLoad:
        elapsed = (self.loop.now - self.started) * 1e3 if self.started is not None else 0.0
        return load_of(
            self.engine.stats(), self.engine.config.block_size, self.last_iteration_ms, self.iterations, elapsed
        )
