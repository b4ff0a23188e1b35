"""A simulated mesh from `epdmesh serve`'s arguments, built by the code `serve` runs: its parser, the model it
resolves, each worker's engine configuration (`engine_config`: stage budgets from the profile and the SLOs), the
launcher's join mode, the routing policy (`routing_policy`), and each worker's registration. Requests become prompts
as the gateway makes them: the checkpoint's chat processor and the route summary's prefix fields."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from common.engine.emulated import EmulatedEngine, word_token_pool
from common.model.config import LlavaConfig
from common.model.processor import ChatProcessor, image_digests
from common.policy.affinity import summary_fields
from common.policy.planner import Planner, label
from common.topology import decoders_join, parse_topology
from common.workers import WorkerInfo, registered_budgets
from epdmesh.cli import build_parser
from epdmesh.engine_setup import engine_config, resolve_model
from epdmesh.options import planner_config, routing_policy
from services.gateway.protocol import parse_conversation
from services.gateway.tokenize import tokenize
from services.routing.book import RouteBook
from sim.events import Loop
from sim.mesh import Prompt, SimMesh
from sim.switch import Planning
from sim.worker import SimWorker

# The emulated pages' own bytes a token, the least the engine takes: a simulated mesh's pages never leave the
# process, and what they stand for is counted in the model's bytes whatever these are (cache capacity, transfer
# times). Serve's `--emulated-kv-bytes-per-token` (256) made each worker's cache ~40 MiB on H20, and a stamp's first
# write into a fresh 2 MiB page of it cost ~3.7 ms on these hosts (the kernel compacting memory for a huge page).
PAGE_KV_BYTES, PAGE_IMAGE_BYTES = 8, 4


@dataclasses.dataclass
class Setup:
    args: object  # `epdmesh serve`'s parsed arguments
    processor: ChatProcessor
    model_config: LlavaConfig
    token_pool: list[int] | None

    @classmethod
    def of(cls, serve_args: list[str]) -> Setup:
        args = build_parser().parse_args(["serve", *serve_args])
        if args.backend != "emulated":
            raise SystemExit("the simulator runs the emulated backend: give --backend emulated --profile P")
        if args.topology == "local":
            raise SystemExit("the simulator runs meshes: give --topology (e.g. EPD1)")
        resolve_model(args)
        groups = parse_topology(args.topology)
        if args.decoder_joins == "auto":  # as `serve` resolves it (epdmesh/launch.py)
            args.decoder_joins = "first" if decoders_join(groups) else "off"
        model_config = LlavaConfig.from_pretrained(args.model)
        return cls(args, ChatProcessor(args.model, model_config), model_config, word_token_pool(args.model))

    @property
    def model(self) -> str:
        return self.args.served_model_name

    def mesh(self, loop: Loop, control_scale: float = 1.0, planner_phase: float = 0.0) -> SimMesh:
        args = self.args
        routing, slo = routing_policy(args)
        workers = []
        for group in parse_topology(args.topology):
            config = engine_config(args, group.label)
            for i in range(group.count):
                engine = EmulatedEngine(
                    config,
                    _profile(args.profile),
                    None,
                    self.token_pool,
                    PAGE_KV_BYTES,
                    PAGE_IMAGE_BYTES,
                    self.model_config,
                )
                worker_id = f"{group.label.lower()}-{i}"
                info = WorkerInfo(
                    worker_id,
                    f"sim:{worker_id}",
                    config.roles,
                    self.model,
                    engine.max_model_len,
                    "sim",
                    instance="sim",
                    prefix_caching=config.enable_prefix_caching,
                    **registered_budgets(engine.scheduler.config),
                )
                workers.append(SimWorker(loop, info, engine, deliver=None))
        book = RouteBook(routing, slo, reports_delivery=True)  # as the gateway's router
        planning = self.planning(control_scale) if args.planner else None
        hold = args.slo_ttft_ms / 1e3 if args.first_token_hold else None  # as the gateway (`epdmesh/cli.py`)
        return SimMesh(loop, workers, book, self.model_config, control_scale, planning, planner_phase, hold)

    def planning(self, control_scale: float) -> Planning:
        """The gateway's planner as `serve --planner` makes it (`epdmesh/cli.py`), its intervals on simulated time."""
        args = self.args
        if not args.latency_profile:
            raise SystemExit("--planner needs a latency profile (--latency-profile)")
        config = planner_config(args)
        return Planning(
            Planner(_profile(args.latency_profile), args.slo_ttft_ms, args.slo_tbt_ms, config),
            lambda roles: engine_config(args, label(roles)),
            config.interval_s / control_scale,
            config.grace_s / control_scale,
            args.slo_ttft_ms / 1e3,
            args.slo_tbt_ms / 1e3,
        )

    def prompt(self, body: dict) -> Prompt:
        """A chat body as the gateway hands it on: token ids, image digests, prefix fields."""
        conversation = parse_conversation(body["messages"])
        ids = self.processor.prompt_ids(conversation)
        digests = image_digests(conversation)
        return Prompt(ids, digests, body["max_tokens"], summary_fields(ids, digests, self.model_config))

    def count_tokens(self, body: dict) -> dict:
        """`POST /tokenize` as the gateway answers it (what `bench/conversation.py` calibrates its words on)."""
        max_len = self.model_config.text.max_position_embeddings
        raw = json.dumps(body).encode()
        return asyncio.run(tokenize(raw, self.processor, self.model, max_len, max_len * self.processor.max_token_chars))


_PROFILES: dict[str, object] = {}


def _profile(path: str):
    """Each profile file read once (every worker of every point runs the same)."""
    from common.latency.roofline import load_profile

    if path not in _PROFILES:
        _PROFILES[path] = load_profile(path)
    return _PROFILES[path]
