"""Stage-level batching (TriInfer Algorithm 1) for one worker's role set. No torch.

Each `schedule()` forms one iteration:
  1. every running decode (one token each), up to `max_num_seqs` (beyond it they take turns) — the
     token budget never holds back a running decode; decodes over it leave no room for new work.
     Each gets the KV block its next token needs; when none is free, the running request that arrived last
     is preempted (vLLM's order) until one is or the request itself was: its blocks are freed,
     and it waits at the front of the queue to recompute its prompt and output so far, or — when its
     images are not here to recompute from — is handed back (`SchedulerOutput.handed_back`);
  2. unfinished work: prefill chunks in progress, then images of partly encoded requests;
  3. new work from the queues, oldest first, while the token budget τ_t (prefill + decode
     tokens) and the image budget τ_e (images through the vision tower) last; nothing new takes KV
     blocks while a preempted request waits for them. With `image_token_cost`, each image encoded also takes
     that many tokens of τ_t (the iteration's time is shared), and one image may still start an iteration
     with no other new work, so images never starve behind long decode batches. With `iteration_time`, τ_t is
     also held to what the step's decodes leave of the iteration's time limit (a decode at a long context
     costs far more than the one token τ_t counts), less what iterations here overrun the profile by
     (`observe`); a later chunk of a prompt is sized with its attention to the chunks before it. With `gap_slack`,
     an iteration whose decodes can all spare one more gap past the TBT target (their P90 still within it) runs to
     the slack's longer limit instead, and each decode in an iteration that outlasts the target counts a slow gap
     (as does each request handed over while it ran: its first gap waits it out).
A request whose last images a step encodes starts its prefill in that same step when τ_t has room (the
runner encodes before the forward): it does not wait a whole iteration between its encode and its prefill.
With `join_first` (a decoder that prefills while prefill workers hand requests over to it), the iteration
that carries a handed-over request's first decode takes no prefill or encode work when the one before did:
the request waits for the iteration in flight plus a decode-only one, not two prefill iterations. Every
other iteration carries prefill work again, so a stream of joiners cannot starve the prefills.
Queues, in the order a request moves through them:
  waiting (new) → encoding → ready (encoded, waiting for KV) → prefilling → running (decode).
A request whose last stage here is done leaves them as HANDED_OFF, pages kept for export.
With prefix caching, a request whose cached prefix already holds the KV of all its image placeholders skips
the vision tower (as vLLM does): it goes from waiting straight to prefilling, from the end of that prefix.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from common.kv_manager import ImageBlockManager, KVBlockManager
from common.latency.budgets import GapSlack, IterationTime, Overrun
from common.request import Request, RequestStatus, Stage

KV_ADMISSION = ("on-demand", "worst-case")
MIN_CHUNK = 16  # prompt tokens an iteration carries however long its decodes take (with `iteration_time`)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    token_budget: int = 2048  # τ_t: tokens (prefill chunks + decodes) per iteration
    image_budget: int = 4  # τ_e: images encoded per iteration
    max_num_seqs: int = 64  # requests decoding at once
    enable_chunked_prefill: bool = True
    join_first: bool = False  # a handed-over request's first decode goes in a decode-only iteration (see above)
    kv_admission: str = "on-demand"  # or "worst-case": blocks for prompt + max_tokens at admission, never preempts
    # on demand: output tokens a decoder keeps room for beyond a handed-over prompt before it takes the pages in (a
    # route books no decoder room on path ①: the decoder books it here, when the pages come; `reservations.py`)
    handover_output_tokens: int = 0
    image_token_cost: int = 0  # tokens of τ_t one image's encode takes in the same iteration (0: budgets apart)
    iteration_time: IterationTime | None = None  # the limit τ_t came from: new work gets what the decodes leave
    gap_slack: GapSlack | None = None  # with `iteration_time`: iterations run long while every decode spares a gap

    def __post_init__(self) -> None:
        for name in ("token_budget", "image_budget", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.handover_output_tokens < 0:
            raise ValueError("handover_output_tokens must be at least 0")
        if self.image_token_cost < 0:
            raise ValueError("image_token_cost must be at least 0")
        if self.kv_admission not in KV_ADMISSION:
            raise ValueError(f"kv_admission must be one of {KV_ADMISSION}, got {self.kv_admission!r}")
        if self.gap_slack is not None and self.iteration_time is None:
            raise ValueError("gap_slack needs iteration_time (budgets derived from a latency profile)")


@dataclasses.dataclass(slots=True)
class PrefillChunk:
    request: Request
    start: int  # first prompt position computed
    num_tokens: int

    @property
    def completes_prefill(self) -> bool:
        """The chunk reaches the end of what the prefill computes: its last position samples."""
        return self.start + self.num_tokens == self.request.num_prefill_tokens


@dataclasses.dataclass(slots=True)
class EncodeWork:
    request: Request
    first_image: int
    num_images: int


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    decodes: list[Request] = dataclasses.field(default_factory=list)  # each computes its last token, samples one
    prefills: list[PrefillChunk] = dataclasses.field(default_factory=list)  # prompt chunks, in request order
    encodes: list[EncodeWork] = dataclasses.field(default_factory=list)  # images through the vision tower
    handed_back: list[Request] = dataclasses.field(default_factory=list)  # preempted, not recomputable here: out
    predicted_ms: float = 0.0  # the iteration's time by the profile (with `iteration_time`; 0 otherwise)
    joiners: list[Request] = dataclasses.field(default_factory=list)  # decodes handed over, decoding here first

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def num_images(self) -> int:
        return sum(e.num_images for e in self.encodes)

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills or self.encodes)

    @property
    def requests(self) -> list[Request]:
        """Every request with work in this step (a request may appear once per kind of work)."""
        return [*self.decodes, *(c.request for c in self.prefills), *(e.request for e in self.encodes)]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVBlockManager, images: ImageBlockManager, image_token_id: int | None = None
    ):
        """`image_token_id`: the model's image placeholder, to find where a prompt's images end (None: every image
        is encoded, whatever the prefix cache holds)."""
        self.config = config
        self.kv = kv
        self.images = images
        self.image_token_id = image_token_id
        self.num_encodes_skipped = 0  # requests whose images' KV the prefix cache held: no vision tower run
        self.waiting: deque[Request] = deque()
        self.encoding: list[Request] = []
        self.ready: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.joined: set[str] = set()  # handed-over requests (KV in place) that have not decoded here yet
        # requests whose pages are being imported (the engine's `PageHandover.importing`): a handed-over one joins
        # the decodes when its KV is in, and its first gap is the iteration it arrives during
        self.incoming: dict[str, Request] = {}
        self._first_gap_slow: set[str] = set()  # joining requests whose first gap here is counted slow already
        self._last_had_work = False  # the last iteration carried prefill chunks or encodes
        self.num_preemptions = 0  # since start: recomputed here or handed back
        self.overrun = Overrun()  # of iterations carrying prompt work only, past `iteration_time`'s profile
        self.encode_overrun = Overrun()  # of iterations that encode: an image here may cost more than profiled

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.encoding or self.ready or self.prefilling or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.encoding) + len(self.ready) + len(self.prefilling) + len(self.running)

    def add(self, request: Request) -> None:
        """Queue a request. One arriving with its KV already in place (DECODE first) is running at once."""
        if request.first_stage == Stage.DECODE:
            request.status = RequestStatus.DECODING
            self.running.append(request)
            self.joined.add(request.request_id)
        elif request.first_stage == Stage.PREFILL and request.image_block_table:
            self.ready.append(request)  # image pages imported: straight to the prefill queue
        elif request.first_stage == Stage.PREFILL and request.block_table:
            request.status = RequestStatus.PREFILLING  # KV blocks taken already, its images' KV cached (`pin_cached`)
            self.prefilling.append(request)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        cap = self.config.max_num_seqs  # every running decode: τ_t limits new work, never a decode's next token
        taking_turns = len(self.running) > cap
        out.decodes = self._with_room(self.running[:cap], out)
        if taking_turns:  # more arrived with their KV than the batch holds: take turns, none starves
            n = len(out.decodes)
            self.running = self.running[n:] + self.running[:n]
        timing, tokens, images = self.config.iteration_time, self.config.token_budget, self.config.image_budget
        runs_long = self._runs_long(out)
        if runs_long:
            timing, tokens = self.config.gap_slack.long, self.config.gap_slack.token_budget
        tokens -= len(out.decodes)
        context = sum(r.num_computed_tokens for r in out.decodes) if timing else 0
        if timing is not None and tokens > 0 and self._work_waits:  # (what decodes leave matters only to such work)
            tokens = self._tokens_beside(out, timing, context, tokens)
        joining = False
        if self.joined:  # none left once every joiner has decoded: nothing to look up
            out.joiners = [r for r in out.decodes if r.request_id in self.joined]
            joining = bool(out.joiners)
            self.joined.difference_update(r.request_id for r in out.decodes)
        if joining and self.config.join_first and self._last_had_work:
            self._last_had_work = False
            return out  # decodes only: the joiners' first gap is the iteration before plus this short one
        # an image that alone outlasts the limit is encoded anyway in a step with no other new work — unless, with
        # gap slack, that step would give decodes a slow gap they cannot spare: then it waits for one they can
        may_overrun = runs_long or self.config.gap_slack is None or not out.decodes
        self._schedule_new_work(out, timing, tokens, images, context, may_overrun)
        self._last_had_work = bool(out.prefills or out.encodes)
        if self.config.iteration_time is not None:
            out.predicted_ms = self.config.iteration_time.predict_ms(
                out.num_images, len(out.decodes), context, [(c.num_tokens, c.start) for c in out.prefills]
            )
        return out

    def observe(self, out: SchedulerOutput, elapsed_ms: float, now: float | None = None) -> None:
        """The time the iteration `out` took (called by the engine): with `iteration_time`, iterations that
        carried prompt or image work teach `overrun` / `encode_overrun`, which size the next ones. `now`: the
        engine's clock at its end (that of the requests' `arrival_time`), which times a handed-over request's
        first gap here."""
        if out.predicted_ms and (out.prefills or out.encodes):
            (self.encode_overrun if out.encodes else self.overrun).observe(out.predicted_ms, elapsed_ms)
        slack = self.config.gap_slack
        if slack is None:
            return
        counted = self._first_gap_slow
        if elapsed_ms > slack.target_ms:
            for request in out.decodes:
                if request.request_id not in counted:  # else this step ends a first gap counted slow already
                    request.num_slow_gaps += 1
            # requests handed over meanwhile wait it out — those that joined and those whose KV is still on its way
            # (its pull overlaps the iteration): their first gap here is slow, once however many iterations it spans
            for request in self._joining():
                if request.request_id not in counted:
                    counted.add(request.request_id)
                    request.num_slow_gaps += 1
        elif now is not None:
            # a request handed over decodes here first: its first gap began on the prefill worker, before it came
            # here — its KV pull, the rest of the iteration it arrived during, this one. From its arrival here to
            # now is the least that gap lasted: past the target, it is slow (each iteration alone may not be)
            for request in out.joiners:
                if request.request_id not in counted and (now - request.arrival_time) * 1e3 > slack.target_ms:
                    request.num_slow_gaps += 1
        if counted:  # forget those that decoded here or whose import was cancelled
            counted.intersection_update(r.request_id for r in self._joining())

    @property
    def _work_waits(self) -> bool:
        """Prompt or image work is queued here: an encode, a prefill or the rest of one."""
        return bool(self.waiting or self.encoding or self.ready or self.prefilling)

    def _runs_long(self, out: SchedulerOutput) -> bool:
        """With `gap_slack`: prompt work waits and every decode of the step (if any) can spare a slow gap."""
        return self._work_waits and self._may_run_long(out.decodes)

    def _may_run_long(self, decodes: list[Request]) -> bool:
        """Every decode can spare a slow gap, and so can every request handed over whose KV is on its way here (a
        long iteration it arrives during is its first gap: one that cannot spare it would miss its P90 TBT)."""
        slack = self.config.gap_slack
        if slack is None:
            return False
        return all(slack.spare(r.sure_gaps, r.num_slow_gaps) >= 1 for r in (*decodes, *self._incoming_decodes()))

    def _incoming_decodes(self) -> list[Request]:
        """Handed-over requests whose KV is being pulled here (`PageHandover.importing`): they join once it is in."""
        return [r for r in self.incoming.values() if r.first_stage == Stage.DECODE]

    def _joining(self) -> list[Request]:
        """Handed-over requests that have not decoded here yet: joined, or with their KV on its way."""
        return [*(r for r in self.running if r.request_id in self.joined), *self._incoming_decodes()]

    @property
    def long_token_budget(self) -> int:
        """τ_t of the next iteration were prompt work to come now: the slack's where the running decodes (the next
        step's batch) can all spare a slow gap; 0 where they cannot, or without `gap_slack`."""
        if not self._may_run_long(self.running[: self.config.max_num_seqs]):
            return 0
        return self.config.gap_slack.token_budget

    @property
    def image_token_cost(self) -> int:
        """`image_token_cost`, plus (with `iteration_time`) the tokens of what iterations that encode overrun the
        profile by beyond the others — what encoding here costs that the profile did not see."""
        cost = self.config.image_token_cost
        if cost and self.config.iteration_time is not None:
            extra_ms = self.encode_overrun.ms - self.overrun.ms
            per_token = self.config.iteration_time.profile.prefill.per_unit_ms
            if extra_ms > 0 and per_token > 0:
                cost += math.ceil(extra_ms / per_token)
        return cost

    def _tokens_beside(
        self, out: SchedulerOutput, timing: IterationTime, context: int, upper: int, chunk_context: int = 0
    ) -> int:
        """Prompt tokens the iteration's time (`timing`, less `overrun`) leaves beside its decodes — at least
        `MIN_CHUNK` in an iteration without other new work, so prompts never stall behind a long decode batch."""
        fits = timing.tokens_beside(len(out.decodes), context, upper, chunk_context, self.overrun.ms)
        return fits if fits or out.prefills or out.encodes else min(MIN_CHUNK, upper)

    @property
    def preempted_waiting(self) -> bool:
        """A preempted request waits to recompute: blocks that free go to it first (no new admission or import)."""
        return any(r.recompute_outputs for queue in (self.waiting, self.encoding, self.ready) for r in queue)

    def _with_room(self, decodes: list[Request], out: SchedulerOutput) -> list[Request]:
        """The decodes that got the blocks their next token needs, in running order, preempting for them while the
        pool is out the running request that arrived last among those not served this step (vLLM's order)."""
        kept: list[Request] = []
        for request in decodes:
            if request.status != RequestStatus.DECODING:
                continue  # preempted for one before it
            while not self.kv.can_grow(request):
                served = set(map(id, kept))
                victim = max((r for r in self.running if id(r) not in served), key=lambda r: r.arrival_time)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self.kv.grow(request)
                kept.append(request)
        return kept

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        self.running.remove(request)
        self.joined.discard(request.request_id)
        self.kv.free(request)
        request.num_computed_tokens = 0
        if not (request.can_recompute and self.images.could_hold(request)):
            request.status = RequestStatus.HANDED_BACK
            out.handed_back.append(request)
            return
        request.recompute_outputs = len(request.output_token_ids)
        if request.images:  # its embeddings went with its prefill: encode again, from the pixels it keeps
            request.first_stage, request.num_encoded_images = Stage.ENCODE, 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _schedule_new_work(
        self,
        out: SchedulerOutput,
        timing: IterationTime | None,
        tokens: int,
        images: int,
        context: int,
        may_overrun: bool = True,
    ) -> None:
        for request in self.prefilling:
            if timing is not None and request.num_computed_tokens and tokens > 0:
                # a later chunk attends to the prompt before it: fewer tokens fit, its own and any after it
                tokens = self._tokens_beside(out, timing, context, tokens, request.num_computed_tokens)
            tokens -= self._chunk(out, request, tokens)
        encoded = []  # partly encoded requests whose last images this step encodes
        for request in self.encoding:
            n = self._encode(out, request, self._image_room(out, images, tokens, may_overrun))
            images, tokens = images - n, tokens - n * self.image_token_cost
            if self._encodes_rest(request, n):
                encoded.append(request)
        while self.ready and tokens > 0 and self._admit_prefill(self.ready[0]):
            request = self.ready.popleft()
            tokens -= self._chunk(out, request, tokens)
        for request in encoded:  # after the requests encoded before them
            tokens -= self._fuse(out, request, tokens)
        held = any(r.recompute_outputs for r in (*self.ready, *self.encoding))  # nothing newer starts first
        for request in list(self.waiting):  # preempted requests at the front
            if held and not request.recompute_outputs:
                break
            if request.first_stage == Stage.ENCODE and request.needs_encode:
                if self.covers_images(request):  # no vision tower: it waits for room to prefill, not to encode
                    if tokens > 0 and self._admit_without_encode(request):
                        self.waiting.remove(request)
                        tokens -= self._chunk(out, request, tokens)
                elif (room := self._image_room(out, images, tokens, may_overrun)) and self.images.can_allocate(request):
                    self.waiting.remove(request)
                    self.images.allocate(request)
                    request.status = RequestStatus.ENCODING
                    self.encoding.append(request)
                    n = self._encode(out, request, room)
                    images, tokens = images - n, tokens - n * self.image_token_cost
                    if self._encodes_rest(request, n):
                        tokens -= self._fuse(out, request, tokens)
            elif tokens > 0 and self._admit_prefill(request):
                self.waiting.remove(request)
                tokens -= self._chunk(out, request, tokens)
            elif tokens <= 0 and images <= 0:
                break
            held = held or (bool(request.recompute_outputs) and request.status != RequestStatus.PREFILLING)

    def covers_images(self, request: Request) -> bool:
        """The prefix cache holds the KV of every image placeholder of a request this engine prefills."""
        if self.image_token_id is None or not request.images or request.last_stage < Stage.PREFILL:
            return False
        return self.kv.cached_prefix_tokens(request) >= request.image_end(self.image_token_id)

    def _admit_without_encode(self, request: Request) -> bool:
        """Admit to prefill, its images counted as encoded, a request whose images' KV is cached (`covers_images`);
        False when it cannot start yet."""
        encoded, request.num_encoded_images = request.num_encoded_images, len(request.images)
        if not self._admit_prefill(request):
            request.num_encoded_images = encoded
            return False
        self.num_encodes_skipped += 1
        return True

    def _admit_prefill(self, request: Request) -> bool:
        """Move a request into `prefilling` with its KV blocks; False when it cannot start yet."""
        decoding_soon = len(self.running) + len(self.prefilling)
        if decoding_soon >= self.config.max_num_seqs or not self.kv.can_allocate(request):
            return False
        request.num_computed_tokens = self.kv.allocate(request)
        request.status = RequestStatus.PREFILLING
        self.prefilling.append(request)
        return True

    def _chunk(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        start, left = request.num_computed_tokens, request.prefill_remaining
        if self.config.enable_chunked_prefill:
            n = min(left, budget)
        else:
            n = left if (left <= budget or not out.prefills and not out.decodes) else 0
        if n <= 0:
            return 0
        out.prefills.append(PrefillChunk(request, start, n))
        return n

    def _image_room(self, out: SchedulerOutput, images: int, tokens: int, may_overrun: bool = True) -> int:
        """Images this step can still encode: what is left of τ_e and, with `image_token_cost`, of τ_t — at least
        one in a step that carries no prefill or encode yet, if it `may_overrun` its limit."""
        cost = self.image_token_cost
        if not cost or images <= 0:
            return max(images, 0)
        room = max(tokens, 0) // cost
        return min(images, room if room or out.prefills or out.encodes or not may_overrun else 1)

    def _encode(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        n = min(len(request.images) - request.num_encoded_images, budget)
        if n > 0:
            out.encodes.append(EncodeWork(request, request.num_encoded_images, n))
        return n

    @staticmethod
    def _encodes_rest(request: Request, n: int) -> bool:
        """Encoding `n` more images this step finishes the request's images: its prompt can prefill in the step."""
        return n > 0 and request.num_encoded_images + n == len(request.images)

    def _fuse(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        """Start the prefill of a request whose last images this step encodes, in this step: the runner encodes
        before the forward, so the chunk reads embeddings written moments earlier, and the request does not wait
        a whole iteration between its encode and its prefill (as vLLM schedules encoder inputs with the tokens
        that use them). Tokens taken from `budget`."""
        if request.last_stage < Stage.PREFILL or budget <= 0 or not self._admit_prefill(request):
            return 0
        self.encoding.remove(request)  # now prefilling: `finish_encode` leaves it there
        return self._chunk(out, request, budget)

    # ----- called by the engine after the step ran -----

    def finish_encode(self, request: Request) -> None:
        if request.status == RequestStatus.PREFILLING:  # its prefill began in the step that encoded it (`_fuse`)
            return
        self.encoding.remove(request)
        if request.last_stage == Stage.ENCODE:
            request.status = RequestStatus.HANDED_OFF
        else:
            request.status = RequestStatus.WAITING
            self.ready.append(request)

    def finish_prefill(self, request: Request) -> None:
        self.prefilling.remove(request)
        self.kv.commit_prompt(request)
        if request.image_block_table:
            self.images.free(request)
        if request.last_stage == Stage.PREFILL:
            request.status = RequestStatus.HANDED_OFF
        else:
            request.status = RequestStatus.DECODING
            self.running.append(request)

    def take_out(self, request: Request) -> None:
        """Take a request out of every queue, its pages kept."""
        for queue in (self.waiting, self.encoding, self.ready, self.prefilling, self.running):
            if request in queue:
                queue.remove(request)
        self.joined.discard(request.request_id)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of every queue and free its pages (it ends here, finished or aborted)."""
        self.take_out(request)
        if request.block_table:
            self.kv.free(request)
        if request.image_block_table:
            self.images.free(request)
        request.status = status
