"""KV capacity reserved in Redis for routed requests, so several toggles (or gateways) never overbook a worker.

Keys, under the mesh's prefix:
  resv:<worker id>   hash {request id: "<tokens>:<expiry unix s>"}
A route reserves, atomically across its workers (one Lua script), the KV tokens the request will take on
the worker that runs its prompt: on a dedicated prefill worker (path ①) the prompt; on a decoder that prefills it
(colocated, or multiplexed: path ②) the prompt and first `output_tokens` output tokens
(`RoutingConfig.reserved_output_tokens`; decoders allocate KV as a request grows and preempt when they run out, so
booking a whole `max_tokens` — the rest of the context by default — would refuse requests that fit). It succeeds
only if every worker's free KV tokens (its last report) minus what is already reserved there still hold it.

A decoder that gets the prompt's pages from a dedicated prefill worker is not booked at the route: it needs the room
only once the prefill is done, most of a TTFT later, while its running requests free theirs. It takes the pages in
when it has room (waiting up to `IMPORT_WAIT_S`, within the source's lease; then the gateway routes the request again,
`Reason.NO_ROOM`), and the pages wait on the prefill worker meanwhile, whose reported room then shrinks. Booked at
the route, the prefill itself waited at the gateway for decoder room the decoder would have had by its end: a static
split with few decoders lost most of its load to that wait (bench/README.md, "Decoder room").
A reservation ends when the worker reports the request admitted (its heartbeat), when the router that made it
is done with the request (it may end before its decoder sees it), or at its expiry.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from common.policy.routing import PrefillPath, RoutePlan, RouteSummary

TTL_S = 10.0  # a reservation nobody ended (its worker never reported it admitted) ends this long after it was made

# KEYS[i]: reservation hash of worker i. ARGV: request id, now, ttl, then per worker i: tokens, capacity.
# Returns 0 when reserved on every worker, else the 1-based index of the first worker without room.
_RESERVE = """
local now = tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  local tokens, capacity = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  local held = 0
  local entries = redis.call('HGETALL', key)
  for j = 1, #entries, 2 do
    local amount, expiry = string.match(entries[j + 1], '([^:]+):([^:]+)')
    if tonumber(expiry) < now then
      redis.call('HDEL', key, entries[j])
    elseif entries[j] ~= ARGV[1] then
      held = held + tonumber(amount)
    end
  end
  if held + tokens > capacity then
    return i
  end
end
for i, key in ipairs(KEYS) do
  redis.call('HSET', key, ARGV[1], ARGV[2 + 2 * i] .. ':' .. (now + tonumber(ARGV[3])))
  redis.call('EXPIRE', key, math.ceil(tonumber(ARGV[3])) + 1)
end
return 0
"""


def needs(plan: RoutePlan, request: RouteSummary, output_tokens: int) -> dict[str, tuple[int, int]]:
    """worker id → (KV tokens the route books there, that worker's reported free KV tokens): the worker that runs the
    prompt (on path ① the dedicated prefill worker alone; the decoder takes the pages in when it has room)."""
    if plan.path == PrefillPath.DEDICATED:
        return {plan.prefill.worker_id: (request.num_prompt_tokens, plan.prefill.load.kv_tokens_free)}
    decoder = plan.decoder
    return {
        decoder.worker_id: (
            request.num_prompt_tokens + min(request.max_tokens, output_tokens),
            decoder.load.kv_tokens_free,
        )
    }


class Reservations:
    def __init__(self, client: aioredis.Redis, prefix: str, ttl_s: float = TTL_S):
        self.redis = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._reserve = client.register_script(_RESERVE)

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}resv:{worker_id}"

    async def reserve(self, request_id: str, amounts: dict[str, tuple[int, int]]) -> str | None:
        """Reserve on every worker or none; returns None on success, else the worker id without room."""
        workers = sorted(amounts)
        args: list = [request_id, time.time(), self.ttl_s]
        for worker_id in workers:
            args += list(amounts[worker_id])
        failed = int(await self._reserve(keys=[self._key(w) for w in workers], args=args))
        return None if failed == 0 else workers[failed - 1]

    async def release(self, worker_id: str, request_ids: list[str]) -> None:
        if request_ids:
            await self.redis.hdel(self._key(worker_id), *request_ids)

    async def release_request(self, request_id: str, worker_ids) -> None:
        """End one request's reservations on these workers (those it was not already ended on)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hdel(self._key(worker_id), request_id)
            await pipe.execute()

    async def held(self, worker_id: str) -> int:
        """KV tokens currently reserved on a worker (expired entries included until the next reserve)."""
        now = time.time()
        total = 0
        for value in (await self.redis.hgetall(self._key(worker_id))).values():
            amount, expiry = value.decode().split(":")
            total += int(amount) if float(expiry) >= now else 0
        return total


class Ledger:
    """The reservation script's rule kept in memory, for one process that routes on its own clock (the simulator):
    `reserve` books on every worker or none, and only where the worker's reported free KV tokens, less what others
    hold there unexpired, still hold it; an entry ends at its expiry, or when released. `tests/services/
    test_reservations.py` runs one sequence of calls through this and through the Lua script in Redis."""

    def __init__(self, ttl_s: float = TTL_S):
        self.ttl_s = ttl_s
        self.held: dict[str, dict[str, tuple[int, float]]] = {}  # worker id → request id → (tokens, expiry)

    def reserve(self, request_id: str, amounts: dict[str, tuple[int, int]], now: float) -> str | None:
        """None when reserved on every worker, else the first worker id (sorted) without room."""
        workers = sorted(amounts)
        for worker_id in workers:
            tokens, capacity = amounts[worker_id]
            entries = self.held.setdefault(worker_id, {})
            for expired in [r for r, (_, expiry) in entries.items() if expiry < now]:
                del entries[expired]
            if sum(t for r, (t, _) in entries.items() if r != request_id) + tokens > capacity:
                return worker_id
        for worker_id in workers:
            self.held[worker_id][request_id] = (amounts[worker_id][0], now + self.ttl_s)
        return None

    def release(self, worker_id: str, request_ids) -> None:
        entries = self.held.get(worker_id, {})
        for request_id in request_ids:
            entries.pop(request_id, None)

    def release_request(self, request_id: str, worker_ids) -> None:
        for worker_id in worker_ids:
            self.release(worker_id, [request_id])

    def holds(self, worker_id: str, now: float) -> int:
        """KV tokens reserved on a worker, unexpired."""
        return sum(t for t, expiry in self.held.get(worker_id, {}).values() if expiry >= now)
