"""One worker's engine: `step()` = schedule → run → postprocess, over the worker's role set.

Life of a request in the engine:
  1. `add_request` validates it against the model and the roles; pages handed over by the
     previous stage (`image_pages`, `kv_pages`) are written into this engine's caches.
  2. Each `step()` the scheduler picks decodes, prefill chunks and encodes under the budgets;
     the model runner executes them; postprocess appends sampled tokens and checks stops.
  3. A request finishes here (pages freed) or is HANDED_OFF when its last stage here is done;
     then `export_*_pages` returns its pages as bytes and `release` frees them (`handover.py`). One preempted that
     cannot be recomputed here is HANDED_BACK (pages freed, no new tokens): its caller goes on with
     it elsewhere, as a continuation of the tokens it has.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from common.engine.config import EngineConfig
from common.engine.errors import NoRoomForPages, RequestRejected, StepFailed  # noqa: F401 (imported from here too)
from common.engine.grammar import GrammarMasks, GrammarRejected
from common.engine.handover import PageHandover
from common.engine.model_runner import ModelRunner
from common.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from common.engine.sampler import Sampler, logprobs_of
from common.engine.stopping import check_stop
from common.kv_manager import ImageBlockManager, KVBlockManager, blocks_for
from common.memory import commit
from common.model.config import LlavaConfig
from common.model.cuda_graphs import GRAPH_MEMORY_BYTES
from common.model.llava import LlavaModel
from common.model.loader import load_model
from common.model.packed_linear import pack_linears
from common.paged_cache import PagedImageCache, PagedKVCache, PagePayload
from common.request import Request, RequestStatus, Stage
from common.scheduler import Scheduler, SchedulerOutput
from kernels import cpu_prompt, make_attention_backend

log = logging.getLogger(__name__)
# one line per iteration at DEBUG: what it carried, how long it took, what the profile predicted (EPDMESH_DEBUG)
iterations_log = logging.getLogger("epdmesh.iterations")


class Engine:
    computes_logprobs = True  # it has the model's logits to report them from

    def __init__(
        self,
        config: EngineConfig,
        model: LlavaModel | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        memory=None,
    ):
        """`config.kv_cache_gib` None: sized from the GPU's memory after one profile iteration, read by `memory`
        (default: `memory_profile.CudaMemory` of the engine's device; there is none on the CPU)."""
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        if config.kv_cache_gib is None and memory is None:
            if device.type != "cuda":
                raise ValueError(
                    "the KV cache is sized from the GPU's memory only on CUDA; give kv_cache_gib "
                    "(--kv-cache-gib) on the CPU"
                )
            from common.engine.memory_profile import CudaMemory

            memory = CudaMemory(device)  # before the weights load: what is ours, what other processes hold
        self.model = model if model is not None else load_model(config.model, dtype, device)
        self.shared_weights = None  # the host's one copy of the weights this model's parameters are views of
        if config.share_weights and model is None and torch.device(device).type == "cpu":
            from common.model.shared_weights import share

            self.shared_weights = share(self.model, config.model, dtype)
        if self.shared_weights is None:  # packing makes a private copy: shared weights stay as they are mapped
            pack_linears(self.model, tiles=config.amx_tiles)
        cpu_prompt.ENABLED = config.prompt_kernel
        self.compiled = self.compile_seconds = None  # the compiled dense path, and its warm-up's seconds
        if config.compile:
            from common.model.compiled import CompiledModel

            self.compiled = CompiledModel(self.model)
            self.compile_seconds = self.compiled.warm_up(
                text=bool(config.roles - {Stage.ENCODE}), vision=Stage.ENCODE in config.roles
            )

        def setup(c: EngineConfig, reuse=None, graphs: bool = False) -> None:
            text = self.model.cfg.text
            self._build(
                c,
                self.model.cfg,
                (text.num_layers, text.num_kv_heads, text.head_dim),
                text.hidden_size,
                dtype,
                device,
                detokenize,
                reuse=reuse,
            )
            self.runner = ModelRunner(
                self.model,
                self.kv_cache,
                self.image_cache,
                make_attention_backend(c.attention_backend, device),
                self.compiled,
            )
            self.sampler = Sampler(c.seed, self.model_config.eos_token_ids)
            if graphs and graphs_wanted(c):  # (not for the memory profile's engine)
                self.graph_seconds = self.runner.capture_graphs(c.scheduler.max_num_seqs, self.max_model_len)

        def graphs_wanted(c: EngineConfig) -> bool:
            return c.cuda_graphs and device.type == "cuda" and Stage.DECODE in c.roles

        self.graph_seconds = None  # how long capturing the decode CUDA graphs took (None: not captured)

        self.kv_sizing = None  # how the KV cache was sized from the device's memory (memory_profile.KvSizing)
        if config.kv_cache_gib is None:
            from common.engine.memory_profile import profile_kv_cache

            reserve = GRAPH_MEMORY_BYTES if graphs_wanted(config) else 0
            self.kv_sizing = profile_kv_cache(config, setup, self, memory, reserve)
            config = dataclasses.replace(config, kv_cache_gib=self.kv_sizing.kv_cache_bytes / 2**30)
        self._setup = functools.partial(setup, graphs=True)
        self._setup(config)

    def reconfigure(self, config: EngineConfig) -> None:
        """Take a new configuration's roles and scheduler (budgets) on an idle engine: the block managers and the
        scheduler are built again for it, the weights and the caches' memory kept (an image cache grows when a worker
        without one takes a role that needs it). The model, the dtype, the device and the KV cache's size stay this
        engine's (a cache sized from the GPU's memory keeps the size it was given). RuntimeError when a request is
        still here, running or with pages between stages."""
        with self.lock:
            busy = len(self.requests) + len(self.pages.importing) + len(self.pages.handed_off)
            if busy:
                raise RuntimeError(f"the engine holds {busy} requests: it reconfigures only when idle")
            same = ("model", "dtype", "device", "block_size", "image_block_size")
            changed = [name for name in same if getattr(config, name) != getattr(self.config, name)]
            if changed:
                raise ValueError(f"a running engine cannot change its {', '.join(changed)}")
            config = dataclasses.replace(config, kv_cache_gib=self.config.kv_cache_gib)
            before, grammar = self.config.roles, self.grammar  # (its tokenizer, loaded once)
            caches = (self.kv_cache, self.image_cache)
            self.release_caches()
            self._setup(config, caches)
            self.grammar = grammar
            if self.computes_logprobs and config.roles & {Stage.PREFILL, Stage.DECODE}:  # it samples now
                grammar.load()
        if self.compiled is not None:  # the parts it did not run before, compiled now rather than at a first request

            def text(roles):
                return bool(roles - {Stage.ENCODE})

            gains_text, gains_vision = text(config.roles) > text(before), Stage.ENCODE in config.roles - before
            if gains_text or gains_vision:
                self.compiled.warm_up(text=gains_text, vision=gains_vision)

    def hand_back_decodes(self) -> list[RequestOutput]:
        """Every request whose last stage here is decode leaves the engine (`handed_back`): its caller goes on with
        it elsewhere. One that is decoding keeps its KV for the next decoder (the output's `pages`: the prompt and
        every output token but the last, which the next decoder decodes on from); one still before its first token
        has its pages freed and starts again. Requests that hand off to another stage stay and finish."""
        with self.lock:
            outputs = []
            for request in [r for r in self.requests.values() if r.last_stage == Stage.DECODE]:
                decoding = request.status == RequestStatus.DECODING and request.output_token_ids
                if not decoding or request.num_computed_tokens != request.num_tokens - 1:
                    self.scheduler.finish(request, RequestStatus.HANDED_BACK)
                    outputs.append(self._hand_back(request, "its worker is switching roles"))
                    continue
                self.scheduler.take_out(request)
                request.status = RequestStatus.HANDED_BACK
                out = self._hand_back(request, "its worker is switching roles; its KV goes with it")
                out.pages = self.pages.keep(request)
                outputs.append(out)
            return outputs

    def release_caches(self) -> None:
        """Let go of the caches and what refers to them (before others of a new size are allocated in their place)."""
        self.kv_cache = self.image_cache = self.runner = self.scheduler = self.pages = None

    def _build(
        self,
        config: EngineConfig,
        model_config: LlavaConfig,
        kv_shape: tuple[int, int, int],
        image_hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        detokenize,
        count_as: tuple[int, int] | None = None,
        reuse: tuple[PagedKVCache, PagedImageCache] | None = None,
    ) -> None:
        """Caches, block managers and the scheduler for a model of `model_config`, pages of the given shapes
        (`kv_shape` = layers, KV heads, head dim; `image_hidden` values per image token). The cache sizes of
        `config` buy blocks of these pages, or of `count_as` bytes (KV, image) per block when given. `reuse`: the
        caches of this engine before (a role switch): each is kept when it holds at least the blocks this
        configuration buys — the memory a transfer backend registered stays the memory pages are in."""
        self._logprobs: dict[str, TokenLogprob] = {}  # of this step's sampled tokens, for the requests that asked
        self.grammar = GrammarMasks(config.model)  # structured requests' masks
        self.config = config
        self.model_config = model_config
        # held by whoever changes the scheduler and the block managers; `step()` lets go of it while the model
        # runs, so another thread can reserve blocks for incoming pages then (see `AsyncEngine.now`)
        self.lock = threading.RLock()
        # the clock of the requests' `arrival_time` and of the times stamped here (the simulator's: simulated time)
        self.clock: Callable[[], float] = time.monotonic
        text = model_config.text
        self.max_model_len = min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
        kv_block = PagedKVCache.bytes_per_block(config.block_size, *kv_shape, dtype)
        img_block = PagedImageCache.bytes_per_block(config.image_block_size, image_hidden, dtype)
        kv_cost, img_cost = count_as or (kv_block, img_block)
        num_kv = max(1, int(config.kv_cache_gib * 2**30) // kv_cost)
        images_here = Stage.ENCODE in config.roles or Stage.PREFILL in config.roles
        num_img = max(1, int(config.image_cache_gib * 2**30) // img_cost) if images_here else 1
        kept_kv, kept_image = reuse or (None, None)
        if kept_kv is not None and kept_kv.num_blocks >= num_kv:
            self.kv_cache, num_kv = kept_kv, kept_kv.num_blocks
        else:
            self.kv_cache = PagedKVCache(num_kv, config.block_size, *kv_shape, dtype, device)
        if kept_image is not None and kept_image.num_blocks >= num_img:
            self.image_cache, num_img = kept_image, kept_image.num_blocks
        else:
            self.image_cache = PagedImageCache(num_img, config.image_block_size, image_hidden, dtype, device)
        if config.commit_caches:
            started = time.perf_counter()
            kv_here = bool(config.roles - {Stage.ENCODE})  # an encoder's KV cache is never written
            committed = 0
            for cache, used in ((self.kv_cache, kv_here), (self.image_cache, images_here)):
                if used:  # a kept cache too (~4 ms a GiB once its pages are in; its last roles may not have used it):
                    commit(cache.data)  # it holds nothing live, as reconfigure runs idle and rebuilds the block pools
                    committed += cache.data.numel() * cache.data.element_size()
            log.info("caches' %.2f GiB faulted in in %.2f s", committed / 2**30, time.perf_counter() - started)
        self.scheduler = Scheduler(
            config.scheduler,
            KVBlockManager(
                num_kv,
                config.block_size,
                config.enable_prefix_caching,
                worst_case=config.scheduler.kv_admission == "worst-case",
                image_token_id=model_config.image_token_id,
            ),
            ImageBlockManager(num_img, config.image_block_size),
            model_config.image_token_id,
        )
        self.detokenize = detokenize
        self.requests: dict[str, Request] = {}
        self.pages = PageHandover(self.scheduler, self.kv_cache, self.image_cache, config.block_size, self._admit)
        self.captured_logits: dict[str, list[torch.Tensor]] = {}

    # ----- intake -----

    def add_request(
        self,
        request: Request,
        image_pages: PagePayload | None = None,
        kv_pages: PagePayload | None = None,
        capture_logits: bool = False,
        preloaded: bool = False,
    ) -> None:
        """Queue a request. Pages of an earlier stage come as payloads, or were written straight into the
        blocks `reserve_import` gave (`preloaded=True`, the same request object)."""
        if preloaded:
            if self.pages.importing.pop(request.request_id, None) is not request:
                raise RequestRejected(f"no pages were reserved for request {request.request_id!r}")
        else:
            self._admit(request)
            if request.first_stage == Stage.PREFILL and request.images:
                self.pages.import_image_pages(request, image_pages)
            if request.first_stage == Stage.DECODE:
                self.pages.import_kv_pages(request, kv_pages)
        if request.first_stage == Stage.DECODE:
            request.num_computed_tokens = request.num_prompt_tokens
            if Stage.PREFILL in self.config.roles:  # its imported prompt KV serves later prompts prefilled here too
                self.scheduler.kv.commit_prompt(request)  # (a decode-only engine never looks: its blocks stay plain)
        self.requests[request.request_id] = request
        if capture_logits:
            self.captured_logits[request.request_id] = []
        self.scheduler.add(request)

    def _admit(self, request: Request) -> None:
        self._validate(request)
        needed = {s for s in Stage if request.first_stage <= s <= request.last_stage}
        if not needed <= self.config.roles:
            missing = sorted(s.name.lower() for s in needed - self.config.roles)
            raise RequestRejected(f"this engine lacks the role(s) {missing} that request {request.request_id} needs")
        if needed & {Stage.PREFILL, Stage.DECODE}:  # it samples here: its grammar goes on from its tokens so far
            try:
                self.grammar.attach(request)
            except GrammarRejected as e:
                raise RequestRejected(f"response_format: {e}") from None

    def _validate(self, request: Request) -> None:
        vocab = self.model_config.text.vocab_size
        if any(token >= vocab for token, _ in request.sampling.logit_bias):
            raise RequestRejected(f"logit_bias names a token id outside the vocabulary (0..{vocab - 1})")
        if any(token >= vocab for token in request.sampling.stop_token_ids):
            raise RequestRejected(f"stop_token_ids names a token id outside the vocabulary (0..{vocab - 1})")
        if request.sampling.logprobs is not None and not self.computes_logprobs:
            raise RequestRejected("logprobs are not available on this backend: it runs no model")
        if request.sampling.grammar is not None and not self.computes_logprobs:
            raise RequestRejected(
                "structured output (response_format, guided_*, tool calls) is not available on this "
                'backend: it runs no model (with tools, send tool_choice "none")'
            )
        if request.request_id in self.requests or self.pages.holds(request.request_id):
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        cfg = self.model_config
        total = request.num_prompt_tokens + request.sampling.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens ({request.sampling.max_tokens}) is "
                f"{total}, over the model's limit of {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        # the KV this engine would ever hold of it: none when it only encodes here (a GPU encoder's cache is one block),
        # the prompt when it only prefills, prompt and output when it decodes
        kv_tokens = {Stage.ENCODE: 0, Stage.PREFILL: request.num_prompt_tokens, Stage.DECODE: total}[request.last_stage]
        if not self.scheduler.kv.pool.num_blocks >= blocks_for(kv_tokens, self.config.block_size):
            fix = "lower max_tokens" if request.last_stage == Stage.DECODE else "shorten the prompt"
            raise RequestRejected(f"{kv_tokens} tokens do not fit this engine's KV cache; {fix}")
        ids = request.prompt_token_ids
        if ids and not 0 <= min(ids) <= max(ids) < cfg.text.vocab_size:  # (a Python loop over them: 10× slower)
            bad = next(t for t in ids if not 0 <= t < cfg.text.vocab_size)
            raise RequestRejected(f"token id {bad} is outside the vocabulary (0..{cfg.text.vocab_size - 1})")
        placeholders = request.prompt_token_ids.count(cfg.image_token_id)
        if placeholders != request.num_image_tokens or any(
            i.num_tokens != cfg.image_tokens_per_image for i in request.images
        ):
            raise RequestRejected(
                f"the prompt has {placeholders} image placeholder tokens but {len(request.images)} image(s) need "
                f"{len(request.images) * cfg.image_tokens_per_image}"
            )
        size = cfg.vision.image_size  # pixels the vision tower cannot take would fail the whole step, not this request
        for i, img in enumerate(request.images):
            pixels = img.pixel_values
            if pixels is not None and (tuple(pixels.shape) != (3, size, size) or not pixels.is_floating_point()):
                raise RequestRejected(
                    f"image {i}: this model's vision tower takes float pixels [3, {size}, {size}], "
                    f"got {str(pixels.dtype).removeprefix('torch.')} {list(pixels.shape)}"
                )
        if request.sampling.stop and self.detokenize is None:
            raise RequestRejected("stop strings need a tokenizer; this engine was built without one")

    # ----- the loop -----

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        plan, handed_back = self.begin_step()
        if plan is None:
            return handed_back
        started = time.perf_counter()
        sampling, tokens = self.execute_step(plan, handed_back)  # without the lock: the plan's requests and pages
        elapsed_ms = (time.perf_counter() - started) * 1e3
        if iterations_log.isEnabledFor(logging.DEBUG):
            iterations_log.debug(
                "decodes %d (context %d) prompt tokens %d images %d: %.1f ms, predicted %.1f, overrun %.1f / %.1f",
                len(plan.decodes),
                sum(r.num_computed_tokens for r in plan.decodes),
                sum(c.num_tokens for c in plan.prefills),
                plan.num_images,
                elapsed_ms,
                plan.predicted_ms,
                self.scheduler.overrun.ms,
                self.scheduler.encode_overrun.ms,
            )
        return self.end_step(plan, sampling, tokens, elapsed_ms, handed_back)

    # `step` in three parts, for a caller that times the iteration itself (the simulator, `sim/worker.py`)

    def begin_step(self) -> tuple[SchedulerOutput | None, list[RequestOutput]]:
        """The next iteration's plan (None: nothing to run now), and the requests handed back meanwhile."""
        with self.lock:
            plan = self.scheduler.schedule()
            handed_back = [self._hand_back(request) for request in plan.handed_back]
            if plan.is_empty:
                return None, handed_back
            now = self.clock()
            for request in plan.requests:
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
        return plan, handed_back

    def execute_step(
        self, plan: SchedulerOutput, handed_back: list[RequestOutput] = ()
    ) -> tuple[list[Request], list[int]]:
        """Run the plan on the model: the requests that sample and their tokens. StepFailed when the model fails
        (out of memory, say): the caller fails the plan and what else runs."""
        try:
            return self._execute(plan)
        except Exception as e:
            raise StepFailed([request.request_id for request in plan.requests], e, list(handed_back)) from e

    def end_step(
        self,
        plan: SchedulerOutput,
        sampling: list[Request],
        tokens: list[int],
        elapsed_ms: float,
        handed_back: list[RequestOutput] = (),
    ) -> list[RequestOutput]:
        """The iteration's results in the requests: tokens appended, stages finished, pages kept for the next one;
        `elapsed_ms` (what it took) teaches the scheduler its overrun."""
        with self.lock:
            self.scheduler.observe(plan, elapsed_ms, self.clock())
            try:
                return list(handed_back) + self._postprocess(plan, sampling, tokens)
            except Exception as e:  # a bug of ours, part-way through the plan: drop all of it, pages freed
                request_ids = [request.request_id for request in plan.requests]
                for request_id in request_ids:
                    self.abort(request_id)  # aborted, or its handed-off pages freed; a no-op if it finished
                raise StepFailed(request_ids, e, list(handed_back)) from e

    def _postprocess(self, plan: SchedulerOutput, sampling: list[Request], tokens: list[int]) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        for work in plan.encodes:
            work.request.num_encoded_images += work.num_images
            if not work.request.needs_encode:
                self.scheduler.finish_encode(work.request)
                if work.request.status == RequestStatus.HANDED_OFF:
                    outputs[work.request.request_id] = self._handoff(work.request)
        for chunk in plan.prefills:
            chunk.request.num_computed_tokens += chunk.num_tokens
        for request in plan.decodes:
            request.num_computed_tokens += 1
        for request, token in zip(sampling, tokens):
            was_prefill = request.status == RequestStatus.PREFILLING
            request.output_token_ids.append(token)
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
            elif was_prefill:
                self.scheduler.finish_prefill(request)
                if request.status == RequestStatus.HANDED_OFF:
                    outputs[request.request_id] = self._handoff(request, [token])
                    continue
            outputs[request.request_id] = self._output(request, [token])
        return list(outputs.values())

    def _execute(self, plan: SchedulerOutput) -> tuple[list[Request], list[int]]:
        """Run the plan on the model: the requests that sample this step and their sampled tokens."""
        sampling, logits = self.runner.run(plan)
        tokens = self.sampler(self.grammar.masked(logits, sampling), sampling) if sampling else []
        self.grammar.advance(sampling, tokens)
        self._logprobs = logprobs_of(logits, sampling, tokens) if sampling else {}
        for row, request in enumerate(sampling):
            if request.request_id in self.captured_logits:
                self.captured_logits[request.request_id].append(logits[row].clone())
        return sampling, tokens

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        return check_stop(request, token, self.model_config.eos_token_ids, self.max_model_len, self.detokenize)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.done_time = self.clock()
        self.scheduler.finish(request, status)
        del self.requests[request.request_id]

    def _hand_back(
        self, request: Request, why: str = "KV cache full, and its images are not here to recompute from"
    ) -> RequestOutput:
        """A preempted request this engine cannot recompute leaves it (its pages are freed already)."""
        request.done_time = self.clock()
        del self.requests[request.request_id]
        log.info("request %s handed back after %d tokens: %s", request.request_id, len(request.output_token_ids), why)
        return self._output(request, [])

    def _handoff(self, request: Request, new: list[int] | None = None) -> RequestOutput:
        request.done_time = self.clock()
        del self.requests[request.request_id]
        out = self._output(request, new or [])
        out.pages = self.pages.keep(request)
        return out

    def _output(self, request: Request, new: list[int]) -> RequestOutput:
        logprob = self._logprobs.get(request.request_id) if new else None
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new,
            output_token_ids=list(request.output_token_ids),
            status=request.status,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            text=request.output_text if request.sampling.stop and request.status.finished else None,  # the final text
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=[logprob] if logprob is not None and logprob.token_id == new[0] else None,
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its pages; False if unknown or already done."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            return True
        return self.pages.release(request_id)

    def transfer_delay_s(self, kind: str, num_tokens: int) -> float:
        """Extra time an import of `num_tokens` tokens of `kind` pages should take (the emulated engine's
        stand-in for the real model's page bytes); 0 for a real engine."""
        return 0.0

    # ----- conveniences -----

    def generate(self, requests: Iterable[Request], capture_logits: bool = False) -> dict[str, RequestOutput]:
        """Run the given requests to the end of their last stage here; returns each one's final output."""
        final: dict[str, RequestOutput] = {}
        for request in requests:
            self.add_request(request, capture_logits=capture_logits)
        while self.has_unfinished:
            for out in self.step():
                if out.done_here:
                    final[out.request_id] = out
        return final

    def stats(self, posted: Iterable[Request] = ()) -> EngineStats:
        """Under the lock: the scheduler's queues are changed by the engine's thread while others ask (a deque
        changed while this iterated it raised, and ended the worker's heartbeat). `posted`: requests handed to the
        engine's thread that it has not added yet (they wait out the step under way, `AsyncEngine`): counted where
        `add_request` will put them — a report that left them out would show a busy worker's queue empty."""
        with self.lock:
            return self._stats(list(posted))

    def _stats(self, posted: list[Request]) -> EngineStats:
        s = self.scheduler
        joining = [r for r in posted if r.first_stage == Stage.DECODE]  # handed over: they decode at once
        fresh = [r for r in posted if r.first_stage != Stage.DECODE]
        running = [*s.running, *joining]
        to_encode = [*s.waiting, *s.encoding, *(r for r in fresh if r.first_stage == Stage.ENCODE)]
        return EngineStats(
            kv_blocks_total=s.kv.pool.num_blocks,
            kv_blocks_free=s.kv.pool.num_free,
            image_blocks_total=s.images.pool.num_blocks,
            image_blocks_free=s.images.pool.num_free,
            num_waiting=len(s.waiting) + len(s.ready) + len(s.encoding) + len(fresh),
            num_running=len(running) + len(s.prefilling),
            num_handed_off=len(self.pages.handed_off),
            running_decodes=len(running),
            unfinished_decode_tokens=sum(r.sampling.max_tokens - len(r.output_token_ids) for r in running),
            queued_prefill_tokens=sum(
                r.prefill_remaining
                for r in itertools.chain(s.waiting, s.encoding, s.ready, s.prefilling, fresh)
                if r.last_stage >= Stage.PREFILL
            ),
            queued_images=sum(len(r.images) - r.num_encoded_images for r in to_encode),
            decode_context_tokens=sum(r.num_tokens for r in running),
            num_preemptions=s.num_preemptions,
            long_token_budget=s.long_token_budget,
        )
