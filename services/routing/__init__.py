"""Routing as a library: the registry of workers in Redis, KV reservations, and the router that plans each request over
them. The toggle serves it over gRPC (`services/toggle/`); a gateway may run it in-process."""
