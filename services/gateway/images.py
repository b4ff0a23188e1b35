"""A chat's images: base64 data URIs decoded and checked as the body is parsed; http(s) URLs, where the server allows
them (`--allow-remote-images`), fetched by the gateway before the request goes anywhere.

  data:image/...;base64,...   decoded at once (`image_part`): over MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, or longer than
                              MAX_ASPECT_RATIO:1 is refused, as is anything PIL cannot decode
  http(s)://...               refused unless allowed; allowed, the part holds its URL until `ImageFetcher.fetch`
                              gets it: every image of a chat concurrently, each within FETCH_TIMEOUT_S in all
                              (redirects included), at most MAX_IMAGE_BYTES read, then decoded and checked as a data
                              URI's bytes are. `--allowed-image-domains` limits the hosts (each redirect's too).

A fetch that fails is the client's 400 (413 when too big) naming the URL and what went wrong; nothing is routed.
Fetching makes the gateway reach whatever address a client names: run it where that is acceptable, or limit the hosts.
"""

from __future__ import annotations

import asyncio
import binascii
import hashlib
import io
from urllib.parse import urlsplit

import pybase64
from PIL import Image, UnidentifiedImageError

from common.request import IMAGE_DIGEST_KEY
from services.gateway.errors import ApiError

MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 50_000_000
MAX_ASPECT_RATIO = 200  # long side over short side, as Qwen2-VL's processor allows
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5


def image_part(url, where: str, allow_remote: bool) -> dict:
    """A chat's image part: {"type": "image", "image": PIL image}, or — a remote URL this server fetches — {"type":
    "image", "url", "where"} until `ImageFetcher.fetch` puts the image in."""
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}.image_url.url must be a string", "messages")
    if url[:8].lower().startswith(("http://", "https://")):
        if not allow_remote:
            raise ApiError(
                400,
                f"{where}: remote image URLs are disabled on this server; send the image inline as a "
                f"base64 data URI (data:image/png;base64,...)",
                "messages",
            )
        try:
            host = urlsplit(url).hostname
        except ValueError as e:  # e.g. an unclosed IPv6 bracket
            raise ApiError(400, f"{where}: the image URL {url[:200]!r} is not a URL ({e})", "messages") from None
        if not host:
            raise ApiError(400, f"{where}: the image URL {url[:200]!r} names no host", "messages")
        return {"type": "image", "url": url, "where": where}
    if not url.startswith("data:") or ";base64," not in url:
        raise ApiError(
            400,
            f"{where}: image URL must be a base64 data URI like data:image/png;base64,..."
            + (" or an http(s) URL" if allow_remote else ""),
            "messages",
        )
    encoded = url.split(";base64,", 1)[1]
    if len(encoded) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ApiError(413, f"{where}: image is larger than {MAX_IMAGE_BYTES // 2**20} MiB", "messages")
    try:
        data = pybase64.b64decode(encoded, validate=True)  # the stdlib's takes ~50x as long (bench/README)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: image data is not valid base64", "messages") from None
    return {"type": "image", "image": decode_image(data, where)}


def decode_image(data: bytes, where: str) -> Image.Image:
    """An image file's bytes as an RGB image, after the checks that keep a small file from costing gigabytes.
    `where`: the image as the client knows it (its place in the request, and its URL when fetched)."""
    try:
        with Image.open(io.BytesIO(data)) as probe:
            if probe.width * probe.height > MAX_IMAGE_PIXELS:
                raise ApiError(
                    413, f"{where}: image is {probe.width}x{probe.height}, over {MAX_IMAGE_PIXELS} pixels", "messages"
                )
            if max(probe.size) > MAX_ASPECT_RATIO * min(probe.size):  # a 1x16000 PNG of 149 bytes resized to
                # 224 pixels on its short side is 3.6 billion values: gigabytes and seconds in the processor
                raise ApiError(
                    400,
                    f"{where}: image is {probe.width}x{probe.height}, longer than {MAX_ASPECT_RATIO}:1; crop or pad it",
                    "messages",
                )
            probe.verify()
        image = Image.open(io.BytesIO(data))
        image.load()
        rgb = image.convert("RGB")
        rgb.info[IMAGE_DIGEST_KEY] = hashlib.blake2b(
            data, digest_size=16
        ).hexdigest()  # the image's identity in the caches
        return rgb
    except ApiError:
        raise
    except Image.DecompressionBombError as e:  # PIL refuses past twice its own limit, before we see the size
        raise ApiError(413, f"{where}: image is over {MAX_IMAGE_PIXELS} pixels ({e})", "messages") from None
    except UnidentifiedImageError:
        raise ApiError(
            400, f"{where}: not an image this server can read (PNG, JPEG, WebP, GIF, BMP, ...)", "messages"
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ApiError(400, f"{where}: could not decode the image ({e.__class__.__name__}: {e})", "messages") from None


class _HostRefused(Exception):
    pass


class ImageFetcher:
    """The gateway's client for remote images (one connection pool, made in the serving loop at first use)."""

    def __init__(
        self,
        allowed_domains: tuple[str, ...] = (),
        timeout_s: float = FETCH_TIMEOUT_S,
        max_bytes: int = MAX_IMAGE_BYTES,
    ):
        """`allowed_domains`: hosts images may come from (a domain allows its subdomains); empty: any."""
        self.allowed_domains = tuple(d.lower().strip(".") for d in allowed_domains if d)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._client = None

    def allowed(self, host: str | None) -> bool:
        host = (host or "").lower().strip(".")
        return not self.allowed_domains or any(host == d or host.endswith("." + d) for d in self.allowed_domains)

    @staticmethod
    def pending(conversation: list[dict]) -> list[dict]:
        """The chat's image parts still to fetch."""
        return [p for m in conversation for p in m["content"] if p["type"] == "image" and "url" in p]

    async def fetch(self, conversation: list[dict]) -> None:
        """Put every remote image of the chat in its part (concurrently); the first that fails raises its ApiError."""
        pending = self.pending(conversation)
        if not pending:
            return
        tasks = [asyncio.ensure_future(self._one(part["url"], part["where"])) for part in pending]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
        finally:  # one failed (or the client left): the rest stop now, not after downloading for nothing
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for part, task in zip(pending, tasks, strict=True):
            del part["url"], part["where"]
            part["image"] = task.result()

    async def _one(self, url: str, where: str) -> Image.Image:
        if not self.allowed(urlsplit(url).hostname):
            raise ApiError(
                400,
                f"{where}: images from {urlsplit(url).hostname} are not allowed on this server "
                f"(allowed: {', '.join(self.allowed_domains)})",
                "messages",
            )
        import httpx

        try:
            async with asyncio.timeout(self.timeout_s):
                data = await self._read(url, where)
        except TimeoutError:
            raise ApiError(400, f"{where}: fetching {url} took over {self.timeout_s:g} s", "messages") from None
        except _HostRefused as e:
            raise ApiError(
                400,
                f"{where}: {url} redirects to {e}, which this server does not fetch from (allowed: "
                f"{', '.join(self.allowed_domains)})",
                "messages",
            ) from None
        except httpx.TooManyRedirects:
            raise ApiError(400, f"{where}: {url} redirects more than {MAX_REDIRECTS} times", "messages") from None
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:  # ValueError: e.g. a host idna refuses
            raise ApiError(
                400, f"{where}: could not fetch {url} ({type(e).__name__}: {str(e) or 'no detail'})", "messages"
            ) from None
        return await asyncio.to_thread(decode_image, data, f"{where} ({url})")

    async def _read(self, url: str, where: str) -> bytes:
        too_big = ApiError(413, f"{where}: the image at {url} is larger than {self.max_bytes // 2**20} MiB", "messages")
        async with self.client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ApiError(400, f"{where}: fetching {url} answered HTTP {response.status_code}", "messages")
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise too_big
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise too_big
                chunks.append(chunk)
        return b"".join(chunks)

    @property
    def client(self):
        if self._client is None:
            import httpx

            async def check_host(request):  # every request, redirects too
                if not self.allowed(request.url.host):
                    raise _HostRefused(request.url.host)

            self._client = httpx.AsyncClient(
                follow_redirects=True,
                max_redirects=MAX_REDIRECTS,
                trust_env=False,
                timeout=self.timeout_s,
                event_hooks={"request": [check_host]},
                headers={"User-Agent": "epdmesh-gateway"},
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
