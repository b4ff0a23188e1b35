"""A mesh laid out as docker compose lays it out: every service started on its own, workers with fixed ids and
ports, restarted by their supervisor under the same id. A stream whose only decoder dies goes on from the
restarted one (the gateway routes around the dead run of the decoder, not its id): nothing lost, nothing twice."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from common.ports import free_port
from tests.services.servers import MODEL, REDIS_URL, TINY_ENGINE, TINY_IMAGE_CACHE, stop_process, streamed_token_ids


@contextlib.contextmanager
def _spawned(logs: list, name: str, tmp_path, *argv: str):
    log = tmp_path / f"{name}.log"
    logs.append(log)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epdmesh.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        yield proc
    finally:
        stop_process(proc, 30, name)


def _wait(predicate, what: str, logs: list, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen:\n" + "\n".join(p.read_text()[-1500:] for p in logs))
        time.sleep(0.2)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):
        return False


def test_a_stream_goes_on_from_its_only_decoder_restarted_under_the_same_id(tiny_dir, tmp_path):
    prefix, toggle, http_port = f"epdmesh:test-{uuid.uuid4().hex[:8]}:", f"127.0.0.1:{free_port()}", free_port()
    engine = [
        "--model",
        str(tiny_dir),
        *TINY_ENGINE,
        *TINY_IMAGE_CACHE,
        "--transfer",
        "grpc",
        "--toggle",
        toggle,
    ]
    decoder_argv = ["worker", "--roles", "decode", "--worker-id", "decoder", "--port", str(free_port()), *engine]
    base, logs = f"http://127.0.0.1:{http_port}", []
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story about the kitchen"}],
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _spawned(
                logs,
                "toggle",
                tmp_path,
                "toggle",
                "--redis-url",
                REDIS_URL,
                "--prefix",
                prefix,
                "--port",
                toggle.rsplit(":", 1)[1],
            )
        )
        stack.enter_context(
            _spawned(
                logs, "prefill", tmp_path, "worker", "--roles", "encode,prefill", "--worker-id", "prefill", *engine
            )
        )
        decoder = stack.enter_context(_spawned(logs, "decoder", tmp_path, *decoder_argv))
        stack.enter_context(
            _spawned(
                logs,
                "gateway",
                tmp_path,
                "gateway",
                "--model",
                str(tiny_dir),
                "--toggle",
                toggle,
                "--port",
                str(http_port),
                "--served-model-name",
                MODEL,
                "--redis-url",
                REDIS_URL,
                "--prefix",
                prefix,
                "--prefill-mode",
                "dedicated",
            )
        )
        _wait(lambda: _healthy(base), "the mesh coming up", logs)
        whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]

        def crash_and_restart():  # as a crash would; compose's restart policy starts it again
            decoder.send_signal(signal.SIGKILL)
            decoder.wait(30)
            stack.enter_context(_spawned(logs, "decoder-restarted", tmp_path, *decoder_argv))

        streamed = streamed_token_ids(base, body, 20, crash_and_restart)
        assert decoder.returncode == -signal.SIGKILL
        assert streamed == whole  # the stream went on from the restarted decoder: nothing lost, nothing twice
        gateway_log = next(p for p in logs if p.name == "gateway.log").read_text()
        assert "routing around worker decoder#" in gateway_log, gateway_log[-3000:]
