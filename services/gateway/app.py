"""OpenAI-style HTTP API over a generation backend: the mesh (`mesh.MeshBackend`) or one in-process engine
(`local.LocalBackend`).

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
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.engine.outputs import RequestOutput
from common.telemetry.metrics import GatewayMetrics, render
from common.telemetry.tracing import Tracing
from services.gateway import openai_responses, responses_request
from services.gateway.completions import parse_completion_request
from services.gateway.errors import ApiError
from services.gateway.event_stream import EventStream
from services.gateway.images import ImageFetcher
from services.gateway.observe import RequestObserver
from services.gateway.protocol import ChatRequest, parse_chat_request
from services.gateway.responses import Logprobs, collect, completion, internal_error, sse
from services.gateway.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 2**20
INLINE_PARSE_BYTES = 64 * 2**10  # bodies up to this are parsed on the event loop (a thread hop costs more)
# ... unless they build a grammar of some size: 128 tools' took ~25 ms (bench/structured.py), every stream stalled
INLINE_GRAMMAR_BYTES = 2 * 2**10
GRAMMAR_KEYS = (b'"tools"', b'"json_schema"', b'"guided_json"', b'"guided_regex"', b'"structured_outputs"')


def build_app(
    backend,
    model_name: str,
    allow_remote_images: bool = False,
    metrics: GatewayMetrics | None = None,
    tracing: Tracing | None = None,
    allowed_image_domains: tuple[str, ...] = (),
) -> Starlette:
    """`metrics` default: a fresh registry with SLO targets of 2 s TTFT / 200 ms TBT; `tracing` default: from the env.
    `allow_remote_images`: fetch http(s) image URLs (from `allowed_image_domains` only, when given)."""
    fetcher = ImageFetcher(allowed_image_domains) if allow_remote_images else None
    api = Api(
        backend,
        model_name,
        fetcher,
        metrics or GatewayMetrics(model_name, ttft_slo_s=2.0, tbt_slo_s=0.2),
        tracing or Tracing("epdmesh-gateway"),
    )
    routes = [
        Route("/health", api.health),
        Route("/v1/models", api.models),
        Route("/v1/models/{model:path}", api.model),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/stats", api.stats),
        Route("/metrics", api.prometheus),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.text_completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=_lifespan(backend, fetcher),
        exception_handlers={404: _not_found(routes), 405: _wrong_method(routes)},
    )


@dataclasses.dataclass(slots=True)
class _Started:
    """A request under way: its first outputs came."""

    chat: ChatRequest
    request_id: str
    num_prompt: int
    streams: list[AsyncIterator[RequestOutput]]


class Api:
    """The endpoints, over one backend serving one model."""

    def __init__(
        self, backend, model_name: str, fetcher: ImageFetcher | None, metrics: GatewayMetrics, tracing: Tracing
    ):
        self.backend = backend
        self.model_name = model_name
        self.fetcher = fetcher
        self.metrics = metrics
        self.tracing = tracing
        self.created = int(time.time())

    async def health(self, _: HttpRequest) -> Response:
        body = await self.backend.health()
        return JSONResponse(body, status_code=200 if body["status"] in ("ok", "degraded") else 503)

    def _card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "epdmesh",
            "max_model_len": self.backend.max_model_len,
        }

    async def models(self, _: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, http: HttpRequest) -> Response:
        name = http.path_params["model"]
        if name != self.model_name:
            error = ApiError(
                404, f"the model '{name}' does not exist; this server serves ['{self.model_name}']", "model"
            )
            return JSONResponse(error.body(), status_code=404)
        return JSONResponse(self._card())

    async def tokenize(self, http: HttpRequest) -> Response:
        backend = self.backend
        return await _answer(
            http,
            lambda body: tokenize(
                body, backend.processor, self.model_name, backend.max_model_len, _max_text_chars(backend), self.fetcher
            ),
        )

    async def detokenize(self, http: HttpRequest) -> Response:
        async def work(body):
            return detokenize(body, self.backend.processor, self.model_name)

        return await _answer(http, work)

    async def stats(self, _: HttpRequest) -> Response:
        return JSONResponse(await self.backend.stats())

    async def prometheus(self, _: HttpRequest) -> Response:
        body, content_type = render(self.metrics.registry)
        return Response(body, media_type=content_type)

    async def chat_completions(self, http: HttpRequest) -> Response:
        return await self._completions(
            http, lambda body: parse_chat_request(body, [self.model_name], self.fetcher is not None), "chatcmpl", "chat"
        )

    async def text_completions(self, http: HttpRequest) -> Response:
        return await self._completions(
            http, lambda body: parse_completion_request(body, [self.model_name]), "cmpl", "text_completion"
        )

    async def responses(self, http: HttpRequest) -> Response:
        def parse(body: bytes) -> ChatRequest:
            return responses_request.parse_responses_request(body, [self.model_name], self.fetcher is not None)

        return await self._completions(
            http,
            parse,
            "resp",
            "chat",
            openai_responses.stream,
            openai_responses.whole,
            responses_request.in_responses_terms,
        )

    async def _completions(
        self,
        http: HttpRequest,
        parse,
        id_prefix: str,
        operation: str,
        stream=sse,
        whole=completion,
        terms=lambda error: error,
    ) -> Response:
        """Any kind: a chat (messages, images), a text completion (a prompt as it is), or a chat asked for by the
        Responses API; the same stages. `stream` and `whole` shape the answer (`responses.py`, `openai_responses.py`);
        `terms` words an error the way the request's API names its fields."""
        observer = RequestObserver(self.metrics, self.tracing, http.headers, self.model_name, operation)
        started = await self._start(http, parse, id_prefix, observer, terms)
        if isinstance(started, Response):
            return started
        chat, streams = started.chat, [observer.observe(s, started.num_prompt) for s in started.streams]
        logprobs = Logprobs(self.backend.processor.token_text) if chat.sampling.logprobs is not None else None
        if chat.stream:
            return EventStream(
                stream(
                    chat,
                    started.request_id,
                    self.model_name,
                    started.num_prompt,
                    streams,
                    self.backend.detokenize,
                    logprobs,
                )
            )
        try:
            results = await _unless_client_leaves(http, collect(streams, logprobs))
        except ClientDisconnect:  # its requests were cancelled with it
            return Response(status_code=499)
        except ApiError as e:  # a stage failed after the request started
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:
            log.exception("request failed")
            return JSONResponse(internal_error(e).body(), status_code=500)
        return JSONResponse(
            whole(
                chat,
                started.request_id,
                self.model_name,
                started.num_prompt,
                results,
                self.backend.detokenize,
                logprobs is not None,
            )
        )

    async def _start(
        self, http: HttpRequest, parse, id_prefix: str, observer: RequestObserver, terms
    ) -> _Started | Response:
        """Body → request → its first outputs; or the response that says why not (an error, a client gone)."""
        tracing = self.tracing
        try:
            body = await _read_body(http)
            with tracing.activate(observer.span), tracing.span("parse", {"http.request.body.size": len(body)}):
                if _parse_in_thread(body):  # images (base64 + decoding) or a big grammar take ms: keep the loop serving
                    chat = await asyncio.to_thread(parse, body)
                else:
                    chat = parse(body)
            _check_fits(chat, self.backend)  # before fetching: what cannot fit is refused without downloading it
            if self.fetcher is not None and self.fetcher.pending(chat.conversation):
                with tracing.activate(observer.span), tracing.span("fetch_images"):
                    await _unless_client_leaves(http, self.fetcher.fetch(chat.conversation))
            request_id = f"{id_prefix}-{uuid.uuid4().hex}"
            observer.request(chat, request_id)
            num_prompt, streams = await _unless_client_leaves(
                http, _start(self.backend, chat, request_id, observer.span)
            )
            return _Started(chat, request_id, num_prompt, streams)
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


def _parse_in_thread(body: bytes) -> bool:
    return len(body) > INLINE_PARSE_BYTES or (len(body) > INLINE_GRAMMAR_BYTES and any(k in body for k in GRAMMAR_KEYS))


def _not_found(routes: list[Route]):
    async def handler(http: HttpRequest, exc) -> Response:
        served = ", ".join(route.path for route in routes)
        error = ApiError(
            404, f"no such endpoint {http.method} {http.url.path}; this server serves {served}", kind="NotFoundError"
        )
        return JSONResponse(error.body(), status_code=404)

    return handler


def _wrong_method(routes: list[Route]):
    async def handler(http: HttpRequest, exc) -> Response:
        allowed = sorted(
            {m for route in routes if route.matches(http.scope)[0].value for m in route.methods or ()} - {"HEAD"}
        )
        error = ApiError(
            405,
            f"{http.url.path} takes {' or '.join(allowed) or 'another method'}, not {http.method}",
            kind="MethodNotAllowedError",
        )
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
        raise ApiError(
            400,
            f"the {where} hold{'s' if chat.is_text_completion else ''} {n} characters of text, more "
            f"than the model's limit of {backend.max_model_len} tokens can hold; shorten "
            f"{'it' if chat.is_text_completion else 'them'}",
            where,
        )
    config = getattr(backend.processor, "config", None)
    if config is not None and chat.num_images * config.image_tokens_per_image > backend.max_model_len:
        raise ApiError(
            400,
            f"{chat.num_images} images take {chat.num_images * config.image_tokens_per_image} tokens, "
            f"over the model's limit of {backend.max_model_len}; send fewer",
            "messages",
        )


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
        if hasattr(backend, "start_background"):
            await backend.start_background()
        yield
        if fetcher is not None:
            await fetcher.close()
        if hasattr(backend, "close"):
            await backend.close()

    return lifespan
