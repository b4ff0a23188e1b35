"""The worker registry in Redis: soft state with a TTL, so dead workers drop out by themselves.

Keys (all under one prefix, e.g. `epdmesh:<cluster>:`):
  workers            set of worker ids ever registered (pruned when their key is gone; it expires SET_TTL_FACTOR
                     TTLs after the last registration or heartbeat of any worker, so a mesh that stopped
                     leaves nothing behind)
  worker:<id>        hash {info: json, load: json, ts: unix seconds}, expiring ttl after the last heartbeat
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.parse

import redis.asyncio as aioredis

from common.request import Stage
from common.tls import MeshTls
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot

# refresh load + ts and the TTL only if the worker is still known (its info is there), and the set's TTL
_HEARTBEAT = """
if redis.call('hexists', KEYS[1], 'info') == 0 then return 0 end
redis.call('hset', KEYS[1], 'load', ARGV[1], 'ts', ARGV[2])
redis.call('pexpire', KEYS[1], ARGV[3])
redis.call('pexpire', KEYS[2], ARGV[4])
return 1
"""
SET_TTL_FACTOR = 20  # the set outlives every worker key in it (each expires one TTL after its last heartbeat)
REDIS_CONNECTIONS = 64  # per process; a call past them waits for one to be free


def redis_client(url: str, tls: MeshTls | None = None) -> aioredis.Redis:
    """A client whose calls wait for a free connection when all of its pool's are busy. redis-py's default pool
    fails the call instead (MaxConnectionsError past 100), which an overloaded gateway reached: every request
    waiting there for a worker with room routes again, each a Redis call, and past 100 of them the rest got a 500.
    `tls`: a `rediss://` URL's CA and client certificate, unless the URL names its own."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=REDIS_CONNECTIONS, timeout=None, **(tls.redis_kwargs(url) if tls else {})
    )
    return aioredis.Redis(connection_pool=pool)


def redacted(url: str) -> str:
    """`url` without its password, for logs and errors."""
    split = urllib.parse.urlsplit(url)
    if split.password is None:
        return url
    netloc = f"{split.username or ''}:***@{split.hostname}" + (f":{split.port}" if split.port else "")
    return urllib.parse.urlunsplit(split._replace(netloc=netloc))


def _info_json(info: WorkerInfo) -> str:
    d = dataclasses.asdict(info)
    d["roles"] = sorted(s.name for s in info.roles)
    return json.dumps(d)


def _info_from(text: str) -> WorkerInfo:
    d = json.loads(text)
    d["roles"] = frozenset(Stage[name] for name in d["roles"])
    return WorkerInfo(**d)


class RedisRegistry:
    def __init__(self, client: aioredis.Redis, prefix: str, ttl_s: float = 3.0):
        if ttl_s <= 0:
            raise ValueError("ttl must be positive")
        self.redis = client
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        self._heartbeat = client.register_script(_HEARTBEAT)

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    async def register(self, info: WorkerInfo, load: WorkerLoad) -> None:
        key = self._key(info.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(
                key, mapping={"info": _info_json(info), "load": json.dumps(dataclasses.asdict(load)), "ts": time.time()}
            )
            pipe.pexpire(key, self.ttl_ms)
            pipe.sadd(f"{self.prefix}workers", info.worker_id)
            pipe.pexpire(f"{self.prefix}workers", self.ttl_ms * SET_TTL_FACTOR)
            await pipe.execute()

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        """False when the registry no longer knows the worker (its TTL passed): it must register again."""
        known = await self._heartbeat(
            keys=[self._key(worker_id), f"{self.prefix}workers"],
            args=[json.dumps(dataclasses.asdict(load)), time.time(), self.ttl_ms, self.ttl_ms * SET_TTL_FACTOR],
        )
        return bool(known)

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(worker_id))
            pipe.srem(f"{self.prefix}workers", worker_id)
            await pipe.execute()

    async def snapshot(self) -> list[WorkerSnapshot]:
        ids = sorted(i.decode() for i in await self.redis.smembers(f"{self.prefix}workers"))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hgetall(self._key(worker_id))
            rows = await pipe.execute()
        now, live, gone = time.time(), [], []
        for worker_id, row in zip(ids, rows):
            if not row or b"info" not in row:
                gone.append(worker_id)
                continue
            load = WorkerLoad(**json.loads(row[b"load"]))
            live.append(WorkerSnapshot(_info_from(row[b"info"]), load, max(0.0, now - float(row[b"ts"]))))
        if gone:
            await self.redis.srem(f"{self.prefix}workers", *gone)
        return live

    async def clear(self) -> None:
        ids = await self.redis.smembers(f"{self.prefix}workers")
        keys = [self._key(i.decode()) for i in ids]
        await self.redis.delete(f"{self.prefix}workers", *keys)
