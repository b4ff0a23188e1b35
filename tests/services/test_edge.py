"""The gateway's edge (`services/gateway/edge.py`): API keys and the client's request id, on a small app."""

import argparse

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from services.gateway.edge import add_api_key_arg, api_keys, edge


async def _ok(_):
    return JSONResponse({"ok": True})


async def _stream(_):
    async def events():
        yield "data: 1\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


APP = Starlette(
    routes=[
        Route("/health", _ok),
        Route("/metrics", _ok),
        Route("/v1/models", _ok),
        Route("/v1/chat/completions", _stream, methods=["POST", "OPTIONS"]),
        Route("/stats", _ok),
    ]
)


def test_with_keys_every_path_but_health_and_metrics_needs_one_of_them_as_a_bearer_token():
    client = TestClient(edge(APP, ("k1", "k2")))
    for path in ("/v1/models", "/stats"):
        missing = client.get(path)
        assert missing.status_code == 401 and "needs an API key" in missing.json()["error"]["message"]
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = client.get(path, headers={"Authorization": "Bearer k3"})
        assert wrong.status_code == 401 and "not one this server takes" in wrong.json()["error"]["message"]
        assert client.get(path, headers={"Authorization": "Basic k1"}).status_code == 401
        for key in ("k1", "k2"):
            assert client.get(path, headers={"Authorization": f"bearer {key}"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    assert client.options("/v1/chat/completions").status_code != 401  # a CORS preflight carries no key
    assert TestClient(edge(APP, ())).get("/v1/models").status_code == 200  # no keys: open


def test_a_request_id_comes_back_on_every_answer_and_one_that_is_not_a_plain_token_does_not():
    client = TestClient(edge(APP, ("k1",)))
    assert client.get("/v1/models", headers={"X-Request-Id": "abc-1"}).headers["x-request-id"] == "abc-1"  # a 401
    streamed = client.post("/v1/chat/completions", headers={"X-Request-Id": "s-2", "Authorization": "Bearer k1"})
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "s-2"
    for bad in ("has space", "x" * 300, "tab\tid"):
        assert "x-request-id" not in client.get("/health", headers={"X-Request-Id": bad}).headers
    assert "x-request-id" not in client.get("/health").headers


def test_keys_come_from_the_flag_else_from_the_environment():
    parser = argparse.ArgumentParser()
    add_api_key_arg(parser)
    assert api_keys(parser.parse_args(["--api-key", "a", "--api-key", "b"]), {"EPDMESH_API_KEY": "c"}) == ("a", "b")
    assert api_keys(parser.parse_args([]), {"EPDMESH_API_KEY": "c, d,"}) == ("c", "d")
    assert api_keys(parser.parse_args([]), {}) == ()
