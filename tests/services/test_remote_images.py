"""Remote image URLs (`--allow-remote-images`): fetched from a real HTTP server on 127.0.0.1, decoded as a data URI's
bytes are, and every way a fetch can go wrong is the client's 4xx naming the URL — before anything is routed."""

import asyncio
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient

from common.telemetry.metrics import GatewayMetrics
from services.gateway.app import build_app
from services.gateway.errors import ApiError
from services.gateway.images import ImageFetcher
from services.gateway.protocol import parse_chat_request
from tests.services.test_gateway_guards import Processor

MODEL = "m"
DROPPED = threading.Event()
PIXELS = np.random.default_rng(5).integers(0, 256, (30, 40, 3), dtype=np.uint8)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(PIXELS).save(buf, format="PNG")
    return buf.getvalue()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 — http.server's name
        port = self.server.server_address[1]
        routes = {
            "/ok.png": (200, {"Content-Type": "image/png"}, _png()),
            "/moved": (302, {"Location": "/ok.png"}, b""),
            "/away": (302, {"Location": f"http://localhost:{port}/ok.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/text": (200, {"Content-Type": "text/plain"}, b"not an image"),
            "/big": (200, {"Content-Length": str(10**9)}, b""),
        }
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path.startswith("/endless"):  # no Content-Length: read until the limit
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"\0" * 65536)
                    if self.path == "/endless-slowly":
                        time.sleep(0.05)
            except OSError:
                DROPPED.set()  # the gateway stopped reading: it gave the fetch up
            return
        status, headers, body = routes.get(self.path, (404, {}, b"no such image"))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path != "/big":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that left mid-answer (the timeout and size tests)
        pass


@pytest.fixture(scope="module")
def images():
    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _chat(url: str, allow: bool = True) -> list[dict]:
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}],
            }
        ],
    }
    return parse_chat_request(json.dumps(body).encode(), [MODEL], allow).conversation


def _fetch(url: str, **kwargs) -> list[dict]:
    async def main():
        fetcher = ImageFetcher(**kwargs)
        conversation = _chat(url)
        try:
            await fetcher.fetch(conversation)
        finally:
            await fetcher.close()
        return conversation

    return asyncio.run(main())


def test_a_remote_image_is_fetched_and_decoded_to_the_pixels_it_holds_redirects_followed(images):
    for path in ("/ok.png", "/moved"):
        (part, text) = _fetch(images + path)[0]["content"]
        assert part.keys() == {"type", "image"} and text["text"] == "What is it?"
        assert np.array_equal(np.asarray(part["image"]), PIXELS)
    with pytest.raises(ApiError, match="remote image URLs are disabled"):
        _chat(images + "/ok.png", allow=False)


@pytest.mark.parametrize(
    "path, kwargs, status, fragment",
    [
        ("/missing.png", {}, 400, "answered HTTP 404"),
        ("/text", {}, 400, "not an image this server can read"),
        ("/big", {}, 413, "larger than 20 MiB"),
        ("/endless", {"max_bytes": 2**20}, 413, "larger than 1 MiB"),
        ("/slow", {"timeout_s": 0.3}, 400, "took over 0.3 s"),
        ("/loop", {}, 400, "redirects more than 5 times"),
        ("/away", {"allowed_domains": ("127.0.0.1",)}, 400, "redirects to localhost"),
        ("/ok.png", {"allowed_domains": ("example.com",)}, 400, "images from 127.0.0.1 are not allowed"),
    ],
)
def test_a_fetch_that_fails_is_a_4xx_that_names_the_url_and_why(images, path, kwargs, status, fragment):
    with pytest.raises(ApiError) as err:
        _fetch(images + path, **kwargs)
    assert err.value.status == status and fragment in err.value.message, err.value.message
    assert err.value.param == "messages" and "messages[0].content[0]" in err.value.message


def test_an_unreachable_host_is_a_400_and_an_allowed_domain_admits_its_subdomains():
    with pytest.raises(ApiError, match="could not fetch http://127.0.0.1:9/x.png"):
        _fetch("http://127.0.0.1:9/x.png")  # the discard port: nothing listens
    fetcher = ImageFetcher(("example.com",))
    assert (
        fetcher.allowed("img.example.com") and fetcher.allowed("EXAMPLE.com.") and not fetcher.allowed("badexample.com")
    )


class Seen:
    """A backend that records the chat it was handed."""

    max_model_len = 100

    def __init__(self):
        self.processor = Processor()
        self.chats = []

    async def start(self, chat, request_id, span=None):
        self.chats.append(chat)
        raise ApiError(400, "seen by the backend")


def test_the_gateway_fetches_before_the_backend_sees_the_chat_and_a_failed_fetch_never_reaches_it(images):
    backend = Seen()
    metrics = GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1)
    with TestClient(build_app(backend, MODEL, allow_remote_images=True, metrics=metrics)) as client:

        def post(url):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            }
            return client.post("/v1/chat/completions", content=json.dumps(body))

        assert post(images + "/ok.png").json()["error"]["message"] == "seen by the backend"
        (part,) = backend.chats[0].conversation[0]["content"]
        assert np.array_equal(np.asarray(part["image"]), PIXELS)
        failed = post(images + "/missing.png")
        assert failed.status_code == 400 and "answered HTTP 404" in failed.json()["error"]["message"]
        assert len(backend.chats) == 1
    with TestClient(build_app(Seen(), MODEL, metrics=GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1))) as client:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": images + "/ok.png"}}]}
            ],
        }
        refused = client.post("/v1/chat/completions", content=json.dumps(body))
        assert refused.status_code == 400 and "disabled on this server" in refused.json()["error"]["message"]


def test_one_image_that_fails_stops_the_others_fetches_and_odd_urls_are_a_400(images):
    async def main():
        fetcher = ImageFetcher()
        body = {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": images + path}}
                        for path in ("/endless-slowly", "/missing.png")
                    ],
                }
            ],
        }
        conversation = parse_chat_request(json.dumps(body).encode(), [MODEL], True).conversation
        try:
            with pytest.raises(ApiError, match="answered HTTP 404"):
                await fetcher.fetch(conversation)
        finally:
            await fetcher.close()

    DROPPED.clear()
    asyncio.run(main())
    assert DROPPED.wait(30)  # the endless one was dropped, not read to its end (~50 s at this pace)
    with pytest.raises(ApiError, match="is not a URL"):
        _chat("http://[/a.png")
    with pytest.raises(ApiError, match="could not fetch"):
        _fetch("http://127.0.0.1:1:2/a.png")
    (part, _) = _fetch(images.replace("http://", "HTTP://") + "/ok.png")[0]["content"]
    assert np.array_equal(np.asarray(part["image"]), PIXELS)


def test_a_chat_with_more_images_than_fit_is_refused_before_any_is_fetched(images):
    backend = Seen()
    backend.processor.config = type("Config", (), {"image_tokens_per_image": 60})()
    with TestClient(
        build_app(backend, MODEL, allow_remote_images=True, metrics=GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1))
    ) as client:
        DROPPED.clear()
        body = {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": images + "/endless-slowly"}} for _ in range(2)
                    ],
                }
            ],
        }
        refused = client.post("/v1/chat/completions", content=json.dumps(body))
        assert refused.status_code == 400 and "2 images take 120 tokens" in refused.json()["error"]["message"]
    assert not DROPPED.is_set() and not backend.chats  # nothing was fetched: no connection was made to be dropped
