"""The simulator's reservations (`Ledger`) against the Lua script in Redis (`Reservations`): one sequence of calls,
the same answers and the same holdings."""

import asyncio
import random
import time
import uuid

import redis.asyncio as aioredis

from services.routing.reservations import Ledger, Reservations
from tests.services.servers import REDIS_URL


def test_the_ledger_answers_as_the_script_in_redis():
    rng = random.Random(7)
    workers = ["d-1", "d-2", "p-1"]

    async def main():
        client = aioredis.from_url(REDIS_URL)
        prefix = f"epdmesh-test:{uuid.uuid4().hex}:"
        script, ledger = Reservations(client, prefix, ttl_s=600.0), Ledger(ttl_s=600.0)
        refused = 0
        try:
            for step in range(300):
                op, rid = rng.random(), f"r{rng.randrange(40)}"
                if op < 0.6:  # a route: a decoder, maybe a prefill worker, each with its reported free tokens
                    chosen = rng.sample(workers, rng.choice([1, 2]))
                    amounts = {w: (rng.randrange(50, 400), rng.randrange(200, 1500)) for w in chosen}
                    expected = await script.reserve(rid, amounts)
                    assert ledger.reserve(rid, amounts, time.time()) == expected, step
                    refused += expected is not None
                elif op < 0.8:  # a worker's heartbeat reports requests admitted
                    worker, ids = rng.choice(workers), [f"r{rng.randrange(40)}" for _ in range(3)]
                    await script.release(worker, ids)
                    ledger.release(worker, ids)
                else:  # the router is done with a request
                    await script.release_request(rid, workers)
                    ledger.release_request(rid, workers)
                for w in workers:
                    assert ledger.holds(w, time.time()) == await script.held(w), (step, w)
            assert 20 < refused < 150  # both answers were exercised
        finally:
            await client.delete(*[f"{prefix}resv:{w}" for w in workers])
            await client.aclose()

    asyncio.run(main())


def test_a_ledger_entry_ends_at_its_expiry():
    ledger = Ledger(ttl_s=10.0)
    assert ledger.reserve("a", {"d": (600, 1000)}, now=0.0) is None
    assert ledger.reserve("b", {"d": (600, 1000)}, now=5.0) == "d"  # a's 600 still held
    assert ledger.reserve("a", {"d": (900, 1000)}, now=5.0) is None  # its own entry is not counted against it
    assert ledger.reserve("b", {"d": (600, 1000)}, now=16.0) is None  # a's ended at 15
    assert ledger.holds("d", 16.0) == 600
