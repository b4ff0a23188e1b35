"""Run an `Engine` on its own thread and stream its outputs to asyncio callers.

Life of a request here:
  1. `generate()` registers an asyncio queue for it and posts it to the engine thread.
  2. The thread adds it (a rejection travels back as the exception), steps the engine while
     anything is unfinished, and hands each output to the caller's loop.
  3. The caller's iterator ends at the finishing output; if the caller stops early (client
     gone), the request is aborted and its pages freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from common.engine.engine import Engine, RequestRejected
from common.engine.grammar import GrammarRejected
from common.engine.outputs import RequestOutput
from common.engine.threads import use_intra_op_threads
from common.paged_cache import PagePayload
from common.request import Request

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(
        self,
        engine: Engine | None = None,
        on_iteration: Callable[[float], None] | None = None,
        build: Callable[[], Engine] | None = None,
        threads: int | None = None,
    ):
        """`on_iteration(seconds)` is called on the engine thread after every step that did work. Instead of an
        `engine`, `build` makes one: it is called on the engine thread, and the constructor returns once it has
        (raising what it raised). `threads`: the engine thread gets that many intra-op threads and every thread
        that has not computed yet, this one included, one (`common/engine/threads.py`)."""
        if (engine is None) == (build is None):
            raise ValueError("give an engine or a function that builds one")
        self.engine: Engine = engine
        self._build = build
        self._threads = threads
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.on_iteration = on_iteration
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # requests posted to the thread and not added yet (they wait out the step under way), by id: `stats` counts
        # them; changed under `_gate`
        self._posted: dict[str, Request] = {}
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._gate = threading.Lock()  # registering work vs. the thread ending: nothing is posted after it ended
        self._dead: EngineDead | None = None  # why the thread ended, once it has
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.iterations = 0
        self.last_iteration_ms = 0.0
        self._iteration_started = 0.0  # perf_counter() at the start of the step under way; 0 between steps
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        if threads is not None:
            use_intra_op_threads(1)  # after the engine thread fixed its own count

    async def generate(
        self,
        request: Request,
        image_pages: PagePayload | None = None,
        kv_pages: PagePayload | None = None,
        preloaded: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of `request` until it finishes or is handed off (or back: preempted); pages of an earlier stage go
        in with it (or are already in the blocks `PageHandover.reserve_import` gave it: `preloaded`)."""
        await self.prepare(request)
        outputs: asyncio.Queue = asyncio.Queue()
        with self._gate:
            if self._dead is not None:
                raise EngineDead(*self._dead.args)  # a fresh one: a shared one grows a traceback per raise
            if request.request_id in self._streams:  # its outputs would go to the other caller, who would hang
                raise RequestRejected(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = (asyncio.get_running_loop(), outputs)
            self._posted[request.request_id] = request
            self._inbox.put(("add", (request, image_pages, kv_pages, preloaded)))
        done = False
        try:
            while not done:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.done_here
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not done:
                self._inbox.put(("abort", request.request_id))

    async def prepare(self, request: Request) -> None:
        """A structured request's grammar matcher built on a thread of its own (a few ms for a JSON schema), not
        under the engine's lock at admission, where it would hold up the step under way."""
        if request.sampling.grammar is None or request.grammar_matcher is not None or not self.engine.computes_logprobs:
            return
        try:
            await asyncio.to_thread(self.engine.grammar.attach, request)
        except GrammarRejected as e:
            raise RequestRejected(f"response_format: {e}") from None

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._gate:
            if self._dead is not None:
                raise EngineDead(*self._dead.args)  # a fresh one: a shared one grows a traceback per raise
            self._inbox.put(("call", (fn, loop, future)))
        return await future

    async def hand_back_decodes(self) -> int:
        """Between steps, hand every request that decodes here back to its caller (`Engine.hand_back_decodes`): its
        stream ends with a handed-back output. Returns how many."""

        def hand_back(engine: Engine) -> int:
            outputs = engine.hand_back_decodes()
            for out in outputs:
                self._deliver(out.request_id, out)
            return len(outputs)

        return await self.call(hand_back)

    async def reconfigure(self, config) -> None:
        """`Engine.reconfigure` between steps, on the engine thread (its caches are allocated where it computes)."""
        await self.call(lambda engine: engine.reconfigure(config))

    def now(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the caller's thread under the engine's lock: at once, even while a step's model
        runs, instead of after the step under way (`call`). Only for what a step never touches: reserving and
        freeing the blocks of requests outside the scheduler (pages being imported, or handed off)."""
        with self.engine.lock:
            return fn(self.engine)

    def stats(self):
        """The engine's statistics, with the requests posted to its thread that wait for the step under way to end
        counted as queued: a worker whose step runs long (a prefill worker's may take α·TTFT) would otherwise
        report an empty queue for all that time, and a router that takes such a report to include what it sent
        there would send more."""
        with self.engine.lock:  # the lock `_apply` holds while it moves a posted request into the engine
            with self._gate:
                posted = list(self._posted.values())
            return self.engine.stats(posted)

    @property
    def iteration_elapsed_ms(self) -> float:
        """How long the step under way has run (0: none is)."""
        started = self._iteration_started
        return (time.perf_counter() - started) * 1e3 if started else 0.0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # its loop is closed: nobody is waiting
                pass

    def _run(self) -> None:
        """The thread: the engine built (if it comes as a function), the loop, then — however it ended — every
        caller still waiting is told."""
        try:
            if self._threads is not None:
                use_intra_op_threads(self._threads)
            if self._build is not None:
                self.engine = self._build()
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._built.set()
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the engine thread failed")
            dead = EngineDead(f"the engine thread has stopped: {type(exc).__name__}: {exc}")
        else:
            dead = EngineDead("the engine has shut down")
        with self._gate:
            self._dead = dead
        while True:  # what was posted before the gate closed
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                _, loop, future = payload
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, future, None, EngineDead(*dead.args))
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDead(*dead.args))

    def _fail_in_flight(self, exc: Exception) -> None:
        """After a failed step: fail its requests (wherever it left them) and all the engine still runs; what it
        handed back before it failed goes out as it is (those requests left the engine whole)."""
        for out in getattr(exc, "delivered", ()):
            self._deliver(out.request_id, out)
        failed = list(getattr(exc, "request_ids", ()))  # the step's own (StepFailed)
        with self.engine.lock:
            for request_id in list(self.engine.requests):
                failed.append(request_id)
                try:
                    self.engine.abort(request_id)
                except Exception:
                    log.exception("aborting %s after the failed step failed too", request_id)
        for request_id in dict.fromkeys(failed):
            self._deliver(request_id, RuntimeError(f"engine failure: {exc}"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    start = self._iteration_started = time.perf_counter()
                    try:
                        outputs = self.engine.step()
                    finally:
                        self._iteration_started = 0.0
                    elapsed = time.perf_counter() - start
                    self.last_iteration_ms = elapsed * 1e3
                    self.iterations += 1
                    for out in outputs:  # first: nothing after the step may lose its outputs
                        self._deliver(out.request_id, out)
                    if self.on_iteration is not None:
                        try:
                            self.on_iteration(elapsed)
                        except Exception:
                            log.exception("the iteration callback failed")
            except Exception as exc:  # a bug of ours: fail what is in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_in_flight(exc)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            with self.engine.lock:
                self._apply(kind, payload)

    def _apply(self, kind: str, payload) -> None:
        if kind == "add":
            request, image_pages, kv_pages, preloaded = payload
            with self._gate:
                self._posted.pop(request.request_id, None)
            try:
                self.engine.add_request(request, image_pages=image_pages, kv_pages=kv_pages, preloaded=preloaded)
            except Exception as exc:
                self._deliver(request.request_id, exc)
        elif kind == "call":
            fn, loop, future = payload
            try:
                result = fn(self.engine)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
        elif kind == "abort":
            self.engine.abort(payload)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
