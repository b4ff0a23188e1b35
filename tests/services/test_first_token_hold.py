"""`--first-token-hold`: a handed-over request's first token goes out with its second, at most until 90% of its TTFT
target (`common/policy/first_token.py`, `services/gateway/mesh/failover.py`). The gateway's wrapper on a stream of
outputs, its rule, and which requests it holds; the simulator applies the same rule (`tests/sim/test_sim.py`)."""

import asyncio
import time
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.engine.outputs import RequestOutput
from common.policy.first_token import HOLD_FRACTION, hold_until, released_at
from common.policy.routing import PrefillPath
from common.request import RequestStatus
from services.gateway.errors import ApiError
from services.gateway.mesh.failover import Failover, _Hold, held_first


def output(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=[token],
        output_token_ids=[token],
        status=RequestStatus.FINISHED_LENGTH if finished else RequestStatus.DECODING,
        finish_reason="length" if finished else None,
    )


def test_the_rule_sends_the_first_token_with_the_second_or_at_the_holds_end_never_before_it_came():
    until = hold_until(10.0, 1.0)
    assert until == pytest.approx(10.0 + HOLD_FRACTION)
    assert released_at(10.2, 10.3, until) == 10.3  # the second came first: both go out together
    assert released_at(10.2, 11.5, until) == pytest.approx(until)  # the hold ends first
    assert released_at(10.95, 11.5, until) == 10.95  # it came after the hold's end: at once


async def _stream(steps, closed: list):
    """Outputs after delays: (seconds, output or an exception to raise)."""
    try:
        for delay, item in steps:
            await asyncio.sleep(delay)
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        closed.append(True)


HELD: list[float] = []  # what the last `_read` reported as held (the gateway's first_token_hold_seconds)


def _read(steps, until_in_s: float | None, take: int | None = None):
    """The (token, seconds since start) the client reads, what it raised, and whether the source was closed."""

    async def go():
        closed, got, start = [], [], time.monotonic()
        hold = _Hold()
        hold.until = None if until_in_s is None else start + until_in_s
        HELD.clear()
        stream = held_first(_stream(steps, closed), hold, HELD.append)
        try:
            async for out in stream:
                got.append((out.new_token_ids[0], time.monotonic() - start))
                if take is not None and len(got) == take:
                    break
        except ApiError as e:
            return got, e, closed
        finally:
            await stream.aclose()
        return got, None, closed

    return asyncio.run(go())


def test_a_held_first_token_goes_out_when_the_second_comes():
    got, error, closed = _read([(0.0, output(1)), (0.15, output(2)), (0.0, output(3, True))], until_in_s=5.0)
    assert [t for t, _ in got] == [1, 2, 3] and error is None and closed == [True]
    assert got[0][1] >= 0.15 and got[1][1] - got[0][1] < got[0][1]  # held for the gap, none after it
    assert HELD == [pytest.approx(got[0][1], abs=0.05)]


def test_a_held_first_token_goes_out_at_the_holds_end_when_the_second_is_late():
    got, _, _ = _read([(0.0, output(1)), (0.6, output(2))], until_in_s=0.1)
    assert [t for t, _ in got] == [1, 2]
    assert 0.1 <= got[0][1] < got[1][1] and got[1][1] >= 0.6  # out at the hold's end, not with the second


def test_a_stream_not_held_passes_through_and_an_error_meanwhile_comes_after_the_first_token():
    got, _, _ = _read([(0.0, output(1)), (0.3, output(2))], until_in_s=None)
    assert [t for t, _ in got] == [1, 2] and got[0][1] < 0.3 and HELD == []
    got, error, closed = _read([(0.0, output(1)), (0.05, ApiError(503, "no decoder"))], until_in_s=5.0)
    assert [t for t, _ in got] == [1] and got[0][1] < 1.0 and error.status == 503 and closed == [True]


def test_a_client_gone_during_the_hold_ends_the_request_at_once():
    """The reader stops after the first token while the second is awaited: the source stream is closed (its route
    and reservations end), not left running."""
    got, _, closed = _read([(0.0, output(1)), (0.05, output(2)), (10.0, output(3))], until_in_s=0.5, take=1)
    assert [t for t, _ in got] == [1] and closed == [True]


@pytest.mark.parametrize(
    "hold_ttft_ms, path, finished, held",
    [
        (1000.0, PrefillPath.DEDICATED, False, True),
        (None, PrefillPath.DEDICATED, False, False),  # not asked for
        (1000.0, PrefillPath.COLOCATED, False, False),  # prefilled where it decodes: no handover gap
        (1000.0, PrefillPath.MULTIPLEXED, False, False),
        (1000.0, PrefillPath.DEDICATED, True, False),  # its only token
    ],
)
def test_only_a_handed_over_first_token_that_is_not_the_last_is_held(hold_ttft_ms, path, finished, held):
    failover = Failover(None, None, None, None, None, hold_ttft_ms)
    assert failover._holds(types.SimpleNamespace(path=path), output(1, finished)) is held


@given(
    first=st.floats(0.0, 5.0),
    gap=st.floats(0.0, 5.0),
    target=st.floats(0.01, 5.0),
)
def test_the_hold_never_fails_a_request_that_met_its_slo_without_it(first, gap, target):
    """A first token that came within its TTFT target goes out within it; the first gap never grows."""
    second = first + gap
    out = released_at(first, second, hold_until(0.0, target))
    assert first <= out <= second  # the first gap, second - out, never grows
    if first <= target:
        assert out <= target
