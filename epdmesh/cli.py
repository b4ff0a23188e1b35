"""The `epdmesh` command: make-tiny-model, serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from common.model.tiny import PRESETS, TinySpec

DEFAULT_MODEL_NAME = "tiny-llava"


def default_model_dir() -> Path:
    home = Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh"))
    return home / "models" / DEFAULT_MODEL_NAME


def make_model(out_dir: Path, preset: str = "tiny", seed: int = 0) -> Path:
    from tqdm import tqdm

    from common.model.tiny import make_tiny_model

    with tqdm(total=3, desc=f"writing {preset} checkpoint", unit="step", file=sys.stderr) as bar:
        make_tiny_model(out_dir, TinySpec(preset=preset, seed=seed), progress=lambda name: (bar.set_postfix_str(name), bar.update()))
    return out_dir


def ensure_default_model() -> Path:
    path = default_model_dir()
    if not (path / "model.safetensors").is_file():
        logging.getLogger("epdmesh").info("no model given: creating the default tiny checkpoint in %s", path)
        tmp = path.with_name(path.name + ".partial")
        make_model(tmp)
        tmp.rename(path)
    return path


def _cmd_make_tiny_model(args) -> int:
    make_model(Path(args.dir), args.preset, args.seed)
    print(args.dir)
    return 0


def _cmd_serve(args) -> int:
    import uvicorn

    from common.engine.async_engine import AsyncEngine
    from common.engine.config import EngineConfig, resolve_dtype
    from common.engine.engine import Engine
    from common.model.processor import ChatProcessor
    from common.scheduler import SchedulerConfig
    from services.gateway.app import LocalBackend, build_app

    model_dir = Path(args.model) if args.model else ensure_default_model()
    name = args.served_model_name or (DEFAULT_MODEL_NAME if not args.model else model_dir.name)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=str(model_dir), dtype=resolve_dtype(args.dtype, args.device), device=args.device, kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduler=SchedulerConfig(token_budget=args.token_budget, image_budget=args.image_budget,
                                  max_num_seqs=args.max_num_seqs),
    )
    processor = ChatProcessor(model_dir)
    engine = AsyncEngine(Engine(config, detokenize=processor.detokenize))
    app = build_app(LocalBackend(processor, engine), name, allow_remote_images=args.allow_remote_images)
    logging.getLogger("epdmesh").info("serving %s (%s) on http://%s:%d/v1", name, model_dir, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-tiny-model", help="write a small random LLaVA-1.5 checkpoint in Hugging Face format")
    make.add_argument("dir")
    make.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_cmd_make_tiny_model)

    serve = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible API")
    serve.add_argument("--model", help=f"Hugging Face llava-1.5 directory (default: the tiny model in {default_model_dir()})")
    serve.add_argument("--served-model-name")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                       help="auto: bfloat16 on CUDA, float32 on CPU")
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--kv-cache-gib", type=float, default=1.0)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--token-budget", type=int, default=2048, help="τ_t: tokens per iteration")
    serve.add_argument("--image-budget", type=int, default=4, help="τ_e: images per iteration")
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flash-attn", "xformers"])
    serve.add_argument("--enable-prefix-caching", action="store_true")
    serve.add_argument("--allow-remote-images", action="store_true", help="accept http(s) image URLs (off by default)")
    serve.add_argument("--threads", type=int, help="torch intra-op threads")
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
