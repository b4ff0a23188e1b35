"""Holding a handed-over request's first token (`--first-token-hold`): one rule, applied by the gateway to a live
stream and by the simulator to a simulated one.

On path ① a request's first token comes from its prefill worker and its second from the decoder it is handed to,
after the KV pull and the decoder's iteration in flight. Where the decoder runs long iterations (prompt chunks
beside its decodes, `--gap-slack`), that first gap is the stream's longest, and on a short answer (a few gaps) it
is its P90 TBT. With the hold, the gateway sends the first token when the second is ready, but never later than
`fraction` of the request's TTFT target after its arrival (nor earlier than it came): the client sees its first
token later, still within its target, and no stall after it. A first token that is the request's last (or that
came after the hold's end) goes out at once; a request prefilled where it decodes is never held.
"""

from __future__ import annotations

from common.policy.routing import PrefillPath

HOLD_FRACTION = 0.9  # at most until this fraction of the TTFT target: the rest is the delivery's margin


def held(path: PrefillPath, finished: bool) -> bool:
    """Whether a request's first output, come on a route of `path`, is held: handed over, and not its last."""
    return path == PrefillPath.DEDICATED and not finished


def hold_until(arrival_s: float, ttft_target_s: float, fraction: float = HOLD_FRACTION) -> float:
    """The latest a held first token waits until (the clock of `arrival_s`)."""
    return arrival_s + fraction * ttft_target_s


def released_at(first_s: float, second_s: float, until_s: float) -> float:
    """When a held first token that came at `first_s` goes out, its second having come at `second_s`: with the
    second, or at the hold's end if that comes first — never before the first token itself came."""
    return max(first_s, min(second_s, until_s))
