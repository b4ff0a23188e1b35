"""Locust load on a running epdmesh: multimodal chat completions (data-URI image + text), streamed,
with time-to-first-token reported as its own metric (request type `TTFT`).

    epdmesh serve --topology E1+P1+D1 &            # or any OpenAI-compatible server with a vision model
    locust -f bench/locustfile.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Environment: EPDMESH_MAX_TOKENS (default 32), EPDMESH_IMAGE_FRACTION (share of requests with an image,
default 1.0). The model is the first one the server lists at /v1/models. Locust patches sockets with
gevent: run it as its own process, never inside another program's event loop or test process.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import time

import numpy as np
from locust import HttpUser, between, task
from PIL import Image

MAX_TOKENS = int(os.environ.get("EPDMESH_MAX_TOKENS", "32"))
IMAGE_FRACTION = float(os.environ.get("EPDMESH_IMAGE_FRACTION", "1.0"))
PROMPTS = [
    "What is in this picture?",
    "Describe the scene in one sentence.",
    "How many people can you see?",
    "What colour is the largest object?",
    "Is there any text in the image? Read it.",
]


def _data_uri(seed: int) -> str:
    rng = np.random.RandomState(seed)
    height, width = rng.randint(120, 480), rng.randint(160, 640)
    buffer = io.BytesIO()
    Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


IMAGES = [_data_uri(seed) for seed in range(8)]


class ChatUser(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.model = self.client.get("/v1/models", name="/v1/models").json()["data"][0]["id"]

    @task
    def chat(self) -> None:
        content = [{"type": "text", "text": random.choice(PROMPTS)}]
        if random.random() < IMAGE_FRACTION:
            content.insert(0, {"type": "image_url", "image_url": {"url": random.choice(IMAGES)}})
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft_ms, finish = None, None
        with self.client.post(
            "/v1/chat/completions", json=body, stream=True, catch_response=True, name="chat (stream)"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    resp.failure(event["error"].get("message", "error in stream"))
                    return
                for choice in event.get("choices", []):
                    if ttft_ms is None and choice.get("delta", {}).get("content"):
                        ttft_ms = (time.perf_counter() - start) * 1e3
                    finish = choice.get("finish_reason") or finish
            if finish is None:
                resp.failure("the stream ended without a finish reason")
                return
            resp.success()
        if ttft_ms is not None:
            self.environment.events.request.fire(
                request_type="TTFT",
                name="chat (stream)",
                response_time=ttft_ms,
                response_length=0,
                exception=None,
                context={},
            )
