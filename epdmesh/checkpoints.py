"""The checkpoints `epdmesh` creates when none is given: the default tiny model, and the config-only
checkpoint an emulated profile's model needs. Written once into $EPDMESH_HOME (a `.partial` directory of this
process's own, renamed when complete, so an interrupted write is never taken for a checkpoint and two processes
writing the same one at once both end with it)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from common.model.tiny import TinySpec

DEFAULT_MODEL_NAME = "tiny-llava"
log = logging.getLogger("epdmesh")


def default_model_dir() -> Path:
    home = Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh"))
    return home / "models" / DEFAULT_MODEL_NAME


def make_model(out_dir: Path, preset: str = "tiny", seed: int = 0, config_only: bool = False) -> Path:
    from tqdm import tqdm

    from common.model.tiny import make_tiny_model

    with tqdm(total=2 if config_only else 3, desc=f"writing {preset} checkpoint", unit="step", file=sys.stderr) as bar:
        make_tiny_model(
            out_dir,
            TinySpec(preset=preset, seed=seed, config_only=config_only),
            progress=lambda name: (bar.set_postfix_str(name), bar.update()),
        )
    return out_dir


def write_once(path: Path, marker: str, write: Callable[[Path], object]) -> Path:
    """path, written by `write` into a directory of this process's own and renamed into place, unless `path /
    marker` is there already. Another process that wrote it first wins; this one's copy is removed."""
    if not (path / marker).is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        shutil.rmtree(tmp, ignore_errors=True)  # a write of an earlier process of this pid that was interrupted
        write(tmp)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / marker).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # the other's copy is in place
    return path


def ensure_default_model() -> Path:
    path = default_model_dir()
    if not (path / "model.safetensors").is_file():
        log.info("no model given: creating the default tiny checkpoint in %s", path)
    return write_once(path, "model.safetensors", make_model)


def ensure_emulated_model(profile: str) -> Path:
    """The config-only checkpoint an emulated profile's model needs, or the default tiny model when the
    profile is of another model (a measured profile of the tiny model, say)."""
    from common.latency.roofline import load_profile
    from common.model.tiny import CONFIG_ONLY_PRESETS

    model = load_profile(profile).model
    if model not in CONFIG_ONLY_PRESETS:
        return ensure_default_model()
    path = default_model_dir().with_name(f"{model}-config")
    if not (path / "config.json").is_file():
        log.info("emulating %s: writing its config-only checkpoint in %s", model, path)
    return write_once(path, "config.json", lambda tmp: make_model(tmp, model, config_only=True))
