"""OpenAI-style HTTP API over a generation backend: the mesh (`mesh.MeshBackend`) or one in-process engine.

Life of a chat request:
  1. parse + validate the body (`protocol.parse_chat_request`); bad input → 4xx, nothing queued.
  2. the backend applies the chat template and preprocesses images (off the event loop),
     then starts generation and yields engine outputs.
  3. non-streaming: collect to the end, answer one `chat.completion`;
     streaming: SSE `chat.completion.chunk`s as tokens arrive, a usage chunk when asked,
     then `[DONE]`. A client that disconnects cancels the stream, which aborts the request
     and frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.engine.async_engine import AsyncEngine
from common.engine.engine import RequestRejected
from common.engine.outputs import RequestOutput
from common.model.processor import ChatProcessor
from common.request import Request
from common.telemetry.metrics import GatewayMetrics, render
from common.telemetry.tracing import Tracing
from services.gateway.completions import parse_completion_request
from services.gateway.event_stream import EventStream
from services.gateway.images import ImageFetcher
from services.gateway import openai_responses
from services.gateway.observe import RequestObserver
from services.gateway.protocol import ApiError, ChatRequest, check_length, parse_chat_request
from services.gateway.responses import Logprobs, Prepended, collect, completion, internal_error, sse
from services.gateway.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 2**20
INLINE_PARSE_BYTES = 64 * 2**10  # bodies up to this are parsed on the event loop (a thread hop costs more)
# ... unless they build a grammar of some size: 128 tools' took ~25 ms (bench/structured.py), every stream stalled
INLINE_GRAMMAR_BYTES = 2 * 2**10
GRAMMAR_KEYS = (b'"tools"', b'"json_schema"', b'"guided_json"', b'"guided_regex"', b'"structured_outputs"')


class LocalBackend:
    """One colocated worker (all roles) in this process."""

    def __init__(self, processor: ChatProcessor, engine: AsyncEngine):
        self.processor = processor
        self.engine = engine

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def context_tokens(self) -> int:
        """The most one request can hold: the model's limit, or the whole KV cache when that holds less."""
        kv = self.engine.engine.scheduler.kv
        return min(self.max_model_len, kv.pool.num_blocks * kv.block_size)

    async def start(self, chat: ChatRequest, request_id: str, span=None) -> tuple[int, AsyncIterator[RequestOutput]]:
        try:
            if not chat.num_images and chat.short_text:  # on the loop: a thread hop costs more than tokenizing
                ids, images = self._inputs(chat)
            else:
                ids, images = await asyncio.to_thread(self._inputs, chat)
        except (ValueError, TypeError, KeyError) as e:
            raise ApiError(400, f"could not build the prompt: {e}") from None
        sampling = chat.sampling_for(len(ids), self.context_tokens)
        check_length(len(ids), sampling.max_tokens, self.max_model_len, chat.max_tokens_given)
        request = Request(request_id, ids, sampling, images, cache_salt=chat.cache_salt)
        stream = self.engine.generate(request)
        try:
            first = await anext(stream)
        except RequestRejected as e:
            raise ApiError(400, str(e)) from None

        return len(ids), Prepended(first, stream)

    def _inputs(self, chat: ChatRequest):
        if chat.is_text_completion:
            return self.processor.encode_prompt(chat.prompt)
        return self.processor.apply(chat.conversation, tools=chat.tool_definitions, template_kwargs=chat.template_kwargs)

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.detokenize(ids)

    async def stats(self) -> dict:
        return _asdict(self.engine.stats())

    async def health(self) -> dict:
        return {"status": "ok"} if self.engine.alive else {"status": "error", "reason": "the engine thread has stopped"}


def _asdict(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}


def build_app(backend, model_name: str, allow_remote_images: bool = False, metrics: GatewayMetrics | None = None,
              tracing: Tracing | None = None, allowed_image_domains: tuple[str, ...] = ()) -> Starlette:
    """`metrics` default: a fresh registry with SLO targets of 2 s TTFT / 200 ms TBT; `tracing` default: from the env.
    `allow_remote_images`: fetch http(s) image URLs (from `allowed_image_domains` only, when given)."""
    created = int(time.time())
    fetcher = ImageFetcher(allowed_image_domains) if allow_remote_images else None
    metrics = metrics or GatewayMetrics(model_name, ttft_slo_s=2.0, tbt_slo_s=0.2)
    tracing = tracing or Tracing("epdmesh-gateway")

    async def health(_: HttpRequest) -> Response:
        body = await backend.health()
        return JSONResponse(body, status_code=200 if body["status"] in ("ok", "degraded") else 503)

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "epdmesh",
                "max_model_len": backend.max_model_len}

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card()]})

    async def model(http: HttpRequest) -> Response:
        name = http.path_params["model"]
        if name != model_name:
            error = ApiError(404, f"the model '{name}' does not exist; this server serves ['{model_name}']", "model")
            return JSONResponse(error.body(), status_code=404)
        return JSONResponse(card())

    async def tokenize_endpoint(http: HttpRequest) -> Response:
        return await _answer(http, lambda body: tokenize(body, backend.processor, model_name, backend.max_model_len,
                                                         _max_text_chars(backend), fetcher))

    async def detokenize_endpoint(http: HttpRequest) -> Response:
        async def work(body):
            return detokenize(body, backend.processor, model_name)
        return await _answer(http, work)

    async def stats(_: HttpRequest) -> Response:
        return JSONResponse(await backend.stats())

    async def prometheus(_: HttpRequest) -> Response:
        body, content_type = render(metrics.registry)
        return Response(body, media_type=content_type)

    def parse_chat(body: bytes) -> ChatRequest:
        return parse_chat_request(body, [model_name], allow_remote_images)

    def parse_completion(body: bytes) -> ChatRequest:
        return parse_completion_request(body, [model_name])

    async def chat_completions(http: HttpRequest) -> Response:
        return await completions(http, parse_chat, "chatcmpl", "chat")

    async def text_completions(http: HttpRequest) -> Response:
        return await completions(http, parse_completion, "cmpl", "text_completion")

    def parse_response(body: bytes) -> ChatRequest:
        return openai_responses.parse_responses_request(body, [model_name], fetcher is not None)

    async def responses_endpoint(http: HttpRequest) -> Response:
        return await completions(http, parse_response, "resp", "chat", openai_responses.stream, openai_responses.whole,
                                 openai_responses.in_responses_terms)

    async def completions(http: HttpRequest, parse, id_prefix: str, operation: str, stream=sse,
                          whole=completion, terms=lambda error: error) -> Response:
        """Any kind: a chat (messages, images), a text completion (a prompt as it is), or a chat asked for by the
        Responses API; the same stages. `stream` and `whole` shape the answer (`responses.py`, `openai_responses.py`);
        `terms` words an error the way the request's API names its fields."""
        observer = RequestObserver(metrics, tracing, http.headers, model_name, operation)
        try:
            body = await _read_body(http)
            with tracing.activate(observer.span), tracing.span("parse", {"http.request.body.size": len(body)}):
                if _parse_in_thread(body):  # images (base64 + decoding) or a big grammar take ms: keep the loop serving
                    chat = await asyncio.to_thread(parse, body)
                else:
                    chat = parse(body)
            _check_fits(chat, backend)  # before fetching: what cannot fit is refused without downloading it
            if fetcher is not None and fetcher.pending(chat.conversation):
                with tracing.activate(observer.span), tracing.span("fetch_images"):
                    await _unless_client_leaves(http, fetcher.fetch(chat.conversation))
            request_id = f"{id_prefix}-{uuid.uuid4().hex}"
            observer.request(chat, request_id)
            num_prompt, streams = await _unless_client_leaves(http, _start(backend, chat, request_id, observer.span))
        except ApiError as e:
            e = terms(e)
            observer.failed(e.status, e.message)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except ClientDisconnect:  # gone while sending its body: nobody to answer, and not an error of ours
            observer.abandoned()
            return Response(status_code=499)
        except Exception as e:  # a bug of ours: still an OpenAI error, counted, and the connection kept
            log.exception("request failed before its first token")
            error = internal_error(e)
            observer.failed(error.status, error.message)
            return JSONResponse(error.body(), status_code=error.status)
        except BaseException:  # cancelled (the server stops, or the client left): the request ends here
            observer.abandoned()
            raise
        streams = [observer.observe(stream, num_prompt) for stream in streams]
        logprobs = Logprobs(backend.processor.token_text) if chat.sampling.logprobs is not None else None
        if chat.stream:
            events = stream(chat, request_id, model_name, num_prompt, streams, backend.detokenize, logprobs)
            return EventStream(events)
        try:
            results = await _unless_client_leaves(http, collect(streams, logprobs))
        except ClientDisconnect:  # its requests were cancelled with it
            return Response(status_code=499)
        except ApiError as e:  # a stage failed after the request started
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:
            log.exception("request failed")
            return JSONResponse(internal_error(e).body(), status_code=500)
        return JSONResponse(whole(chat, request_id, model_name, num_prompt, results, backend.detokenize,
                                  logprobs is not None))

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", model),
        Route("/tokenize", tokenize_endpoint, methods=["POST"]),
        Route("/detokenize", detokenize_endpoint, methods=["POST"]),
        Route("/stats", stats),
        Route("/metrics", prometheus),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/responses", responses_endpoint, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=_lifespan(backend, fetcher),
                     exception_handlers={404: _not_found(routes), 405: _wrong_method(routes)})


def _parse_in_thread(body: bytes) -> bool:
    return len(body) > INLINE_PARSE_BYTES or (len(body) > INLINE_GRAMMAR_BYTES and any(k in body for k in GRAMMAR_KEYS))


def _not_found(routes: list[Route]):
    async def handler(http: HttpRequest, exc) -> Response:
        served = ", ".join(route.path for route in routes)
        error = ApiError(404, f"no such endpoint {http.method} {http.url.path}; this server serves {served}",
                         kind="NotFoundError")
        return JSONResponse(error.body(), status_code=404)
    return handler


def _wrong_method(routes: list[Route]):
    async def handler(http: HttpRequest, exc) -> Response:
        allowed = sorted({m for route in routes if route.matches(http.scope)[0].value for m in route.methods or ()}
                         - {"HEAD"})
        error = ApiError(405, f"{http.url.path} takes {' or '.join(allowed) or 'another method'}, not {http.method}",
                         kind="MethodNotAllowedError")
        return JSONResponse(error.body(), status_code=405, headers={"Allow": ", ".join(allowed)})
    return handler


# Unicode normalization can fold a few characters into one before tokenizing (e.g. Hangul jamo); stay below that
NORMALIZATION_SLACK = 4


def _max_text_chars(backend) -> int:
    """More characters of text than this cannot fit the model, whatever their tokens."""
    return backend.max_model_len * backend.processor.max_token_chars * NORMALIZATION_SLACK


def _check_fits(chat: ChatRequest, backend) -> None:
    """A 400 at once, before tokenizing or preprocessing, for text or images that cannot fit the model: tokenizing
    megabytes of text took seconds and gigabytes before the length check could refuse it."""
    n = chat.num_text_chars
    if n > _max_text_chars(backend):
        where = "prompt" if chat.is_text_completion else "messages"
        raise ApiError(400, f"the {where} hold{'s' if chat.is_text_completion else ''} {n} characters of text, more "
                            f"than the model's limit of {backend.max_model_len} tokens can hold; shorten "
                            f"{'it' if chat.is_text_completion else 'them'}", where)
    config = getattr(backend.processor, "config", None)
    if config is not None and chat.num_images * config.image_tokens_per_image > backend.max_model_len:
        raise ApiError(400, f"{chat.num_images} images take {chat.num_images * config.image_tokens_per_image} tokens, "
                            f"over the model's limit of {backend.max_model_len}; send fewer", "messages")


async def _answer(http: HttpRequest, work) -> Response:
    """`await work(body)` as JSON: an ApiError as OpenAI's error JSON, a client gone as nothing."""
    try:
        return JSONResponse(await _unless_client_leaves(http, work(await _read_body(http))))
    except ApiError as e:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception as e:  # a bug of ours: still an OpenAI error, and the connection kept
        log.exception("%s failed", http.url.path)
        error = internal_error(e)
        return JSONResponse(error.body(), status_code=error.status)


async def _unless_client_leaves(http: HttpRequest, awaitable):
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled — its requests end on the
    workers, whatever stage they are in — and ClientDisconnect is raised. (Starlette notices a client that left
    only when it writes to it: a prefill queued or running for a client gone ran to its end, and an answer that
    was not streamed was generated whole.)"""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone.done() and not gone.cancelled():
            gone.exception()  # retrieved: a receive that failed counts as the client gone
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # its cleanup (aborts, released pages) runs now
    if work.cancelled():
        raise ClientDisconnect()
    return work.result()


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client is gone (the request's body has been read: all that can come is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _read_body(http: HttpRequest) -> bytes:
    """The body, refused with a 413 as soon as it is known to be too big (from its Content-Length, or while it
    streams in without one)."""
    try:
        length = int(http.headers.get("content-length") or 0)
    except ValueError:
        raise ApiError(400, "the Content-Length header is not a number") from None
    if length > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {length} bytes, over {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _start(backend, chat: ChatRequest, request_id: str, span) -> tuple[int, list[AsyncIterator[RequestOutput]]]:
    """The prompt's length and one output stream per choice. n > 1: n requests (ids `<id>-<i>`), a seed s giving
    choice i the seed s + i (as vLLM does), started concurrently; when one cannot start, the others end."""
    if chat.n == 1:
        num_prompt, outputs = await backend.start(chat, request_id, span)
        return num_prompt, [outputs]
    starts = [asyncio.ensure_future(backend.start(chat.choice(i), f"{request_id}-{i}", span)) for i in range(chat.n)]
    try:
        await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in starts if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return starts[0].result()[0], [t.result()[1] for t in starts]
    except BaseException:  # one could not start (or the client left): the others end now, not after their prefill
        for task in starts:
            task.cancel()
        await asyncio.gather(*starts, return_exceptions=True)
        for task in starts:
            if not task.cancelled() and task.exception() is None:
                await task.result()[1].aclose()  # started: its request ends (and its pages are freed)
        raise


def _lifespan(backend, fetcher: ImageFetcher | None):
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if fetcher is not None:
            await fetcher.close()
        if hasattr(backend, "close"):
            await backend.close()
    return lifespan
