"""Latency model: how long encode, prefill, decode and page transfers take — pure functions over a profile.

Two sources, one format (`LatencyProfile`, JSON): *measured* on this machine by `epdmesh profile`,
and *analytic* (`roofline.py`) for accelerators we do not have. No torch here.
"""

from common.latency.model import (
    LatencyProfile,
    StageCost,
    decode_ms,
    encode_ms,
    goodput_bound,
    iteration_ms,
    prefill_chunk_ms,
    prefill_ms,
    request_cost_ms,
    scaled,
    transfer_ms,
)

__all__ = [
    "LatencyProfile",
    "StageCost",
    "decode_ms",
    "encode_ms",
    "goodput_bound",
    "iteration_ms",
    "prefill_chunk_ms",
    "prefill_ms",
    "request_cost_ms",
    "scaled",
    "transfer_ms",
]
