"""The router's registry refresh: fast while routes are being made, slow when idle, fast again at once."""

import asyncio

from common.policy.routing import RouteSummary
from services.routing import router as router_module
from services.routing.router import NoRoute, Router


class CountingRegistry:
    def __init__(self):
        self.reads = 0

    async def snapshot(self):
        self.reads += 1
        return []


def test_an_idle_router_reads_the_registry_seldom_and_a_route_brings_the_fast_cadence_back(monkeypatch):
    monkeypatch.setattr(router_module, "IDLE_AFTER_S", 0.3)

    async def reads_during(registry, seconds):
        before = registry.reads
        await asyncio.sleep(seconds)
        return registry.reads - before

    async def main():
        registry = CountingRegistry()
        router = Router(registry, refresh_s=0.01, idle_refresh_s=0.25)
        refresher = asyncio.ensure_future(router.refresh_forever())
        try:
            idle = await reads_during(registry, 1.0)  # never routed: idle from the start
            try:
                await router.route(RouteSummary("r", 10, 0, 4))
            except NoRoute:  # no workers registered: the route is still asked for
                pass
            busy = await reads_during(registry, 0.2)
            await asyncio.sleep(0.3)  # IDLE_AFTER_S without a route
            idle_again = await reads_during(registry, 1.0)
        finally:
            refresher.cancel()
        return idle, busy, idle_again

    idle, busy, idle_again = asyncio.run(main())
    assert idle <= 6 and idle_again <= 6, (idle, idle_again)  # every 0.25 s, not every 0.01 s (~100 in 1 s)
    assert busy >= 6, busy  # every 0.01 s: ~20 in 0.2 s
