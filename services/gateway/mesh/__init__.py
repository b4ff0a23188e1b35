"""The gateway's side of the mesh, by concept: the backend (`backend`), the chat as a prompt (`prompt`), routes and
waiting for room (`route_client`), a request's attempts with failover and migration (`failover`, `migration`), one
route's stage calls (`stages`), how a call failed (`outcome`), and what `/health` and `/stats` say (`status`,
`route_stats`)."""

from services.gateway.mesh.backend import MeshBackend

__all__ = ["MeshBackend"]
