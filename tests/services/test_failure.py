"""A failed call's typed reason: sent in trailing metadata by the servicers and the toggle, read once by the gateway,
and what the client is told for each; the route plan crosses the toggle's rpc whole."""

import grpc
import pytest

from common.engine.engine import NoRoomForPages
from common.policy.routing import PrefillPath, RoutePlan
from common.request import Stage
from common.transfer import PullFailed
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot
from services import wire
from services.errors import ImagesNotCached, ShuttingDown, reason_for
from services.failure import REASON_KEY, Reason, reason_of
from services.gateway.mesh.outcome import classify, is_uncached
from services.stage_calls.client import rpc_error


def _error(code: grpc.StatusCode, reason: str = "") -> grpc.aio.AioRpcError:
    return rpc_error(code, "details", reason)


def test_the_reason_in_trailing_metadata_wins_over_the_code_and_the_code_speaks_when_there_is_none():
    assert reason_of(_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")) == Reason.REFUSED
    assert reason_of(_error(grpc.StatusCode.RESOURCE_EXHAUSTED)) == Reason.NO_ROOM
    assert reason_of(_error(grpc.StatusCode.UNAVAILABLE)) == Reason.DOWN  # a dead worker sends no metadata
    assert reason_of(_error(grpc.StatusCode.ABORTED, "a-newer-reason")) == Reason.SOURCE_FAILED
    assert reason_of(_error(grpc.StatusCode.UNKNOWN)) == Reason.INTERNAL
    trailing = _error(grpc.StatusCode.FAILED_PRECONDITION, "images-not-cached").trailing_metadata()
    assert list(trailing) == [(REASON_KEY, "images-not-cached")]


def test_a_servicer_names_the_reason_of_each_exception():
    assert reason_for(ImagesNotCached("r")) == (Reason.IMAGES_NOT_CACHED, grpc.StatusCode.FAILED_PRECONDITION)
    assert reason_for(NoRoomForPages("full")) == (Reason.NO_ROOM, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert reason_for(PullFailed("gone")) == (Reason.SOURCE_FAILED, grpc.StatusCode.ABORTED)
    assert reason_for(ShuttingDown("bye")) == (Reason.AWAY, grpc.StatusCode.UNAVAILABLE)
    assert reason_for(RuntimeError("bug")) == (Reason.INTERNAL, grpc.StatusCode.INTERNAL)


def test_the_gateway_blames_the_callee_or_the_pages_source_and_tells_the_client_the_right_status():
    down = classify("decode", _error(grpc.StatusCode.UNAVAILABLE), "d#1", "p#1")
    assert (down.blame, down.api_error().status) == ("d#1", 503)
    source = classify("decode", _error(grpc.StatusCode.ABORTED, "source-failed"), "d#1", "p#1")
    assert source.blame == "p#1" and "could not get its pages" in source.api_error().message
    full = classify("prefill", _error(grpc.StatusCode.RESOURCE_EXHAUSTED), "p#1")
    assert full.no_room and full.api_error().headers == {"Retry-After": "1"}
    bad = classify("prefill", _error(grpc.StatusCode.INVALID_ARGUMENT), "p#1")
    assert (bad.blame, bad.api_error().status) == (None, 400)
    too_large = classify("routing", _error(grpc.StatusCode.INVALID_ARGUMENT, "too-large"))
    assert (too_large.api_error().status, too_large.api_error().param) == (400, "max_tokens")
    assert classify("routing", _error(grpc.StatusCode.INTERNAL)).api_error().status == 500
    assert is_uncached(_error(grpc.StatusCode.FAILED_PRECONDITION, "images-not-cached"))
    assert not is_uncached(_error(grpc.StatusCode.FAILED_PRECONDITION, "mismatch"))


def test_a_worker_that_left_on_purpose_is_routed_around_without_using_up_the_requests_attempts():
    from services.gateway.errors import ApiError
    from services.gateway.mesh.failover import MAX_ATTEMPTS, MAX_AWAY, Attempts

    attempts = Attempts("r")
    for i in range(MAX_ATTEMPTS + 2):  # more switching workers than a request has attempts: it goes on
        away = classify("prefill", _error(grpc.StatusCode.UNAVAILABLE, "away"), f"p#{i}")
        assert away.away and away.blame == f"p#{i}" and away.api_error().status == 503
        attempts.failed(away, 0)
    assert attempts.failures == 0 and attempts.exclude == {f"p#{i}" for i in range(MAX_ATTEMPTS + 2)}
    for i in range(MAX_ATTEMPTS - 1):  # workers that are down count
        attempts.failed(classify("decode", _error(grpc.StatusCode.UNAVAILABLE), f"d#{i}"), 3)
    with pytest.raises(ApiError):
        attempts.failed(classify("decode", _error(grpc.StatusCode.UNAVAILABLE), "d#last"), 3)
    bounded = Attempts("s")  # and the routes to workers away are bounded too
    with pytest.raises(ApiError):
        for i in range(MAX_AWAY + MAX_ATTEMPTS):
            bounded.failed(classify("prefill", _error(grpc.StatusCode.UNAVAILABLE, "away"), f"p#{i}"), 0)


def test_a_route_plan_crosses_the_toggles_rpc_whole():
    def worker(worker_id, *roles, free=0):
        info = WorkerInfo(
            worker_id, f"127.0.0.1:{len(worker_id)}", frozenset(roles), "m", 64, instance="run1", prefix_caching=True
        )
        return WorkerSnapshot(info, WorkerLoad(num_waiting=2, kv_blocks_free=free // 16, last_iteration_ms=7.5), 0.25)

    plan = RoutePlan(
        worker("e", Stage.ENCODE),
        worker("p", Stage.PREFILL),
        worker("dd", Stage.DECODE, free=96),
        PrefillPath.DEDICATED,
        predicted_ttft_ms=123.5,
        images_cached=True,
    )
    assert wire.plan_from_pb(wire.plan_to_pb(plan)) == plan
    text = RoutePlan(None, plan.decoder, plan.decoder, PrefillPath.COLOCATED)
    assert wire.plan_from_pb(wire.plan_to_pb(text)) == text
