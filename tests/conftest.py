import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # the tests fork to exec servers too (epdmesh/__init__.py)
# servers the tests start run eagerly (a compile per worker process would cost seconds each); the parity tests run
# the compiled path on purpose (EngineConfig(compile=True), and a mesh with --no-enforce-eager)
os.environ.setdefault("EPDMESH_ENFORCE_EAGER", "1")
os.environ.setdefault("EPDMESH_AUTO_PROFILE", "0")  # likewise: the auto-profile tests ask for it
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX on loopback, in this process and the servers it starts

import pytest
import torch

from common.model.processor import ChatProcessor
from common.model.tiny import TinySpec, make_tiny_model

SHAPES = ("tiny", "tiny-mha")  # grouped-query attention, multi-head attention


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {preset: make_tiny_model(root / preset, TinySpec(preset=preset)) for preset in SHAPES}


@pytest.fixture(scope="session")
def tiny_dir(model_dirs):
    return model_dirs["tiny"]


@pytest.fixture(scope="session")
def processors(model_dirs):
    return {preset: ChatProcessor(path) for preset, path in model_dirs.items()}


@pytest.fixture(scope="session")
def chat_reference(tiny_dir, processors):
    """The chat cases of the mixed workload and transformers' greedy fp32 answers to them."""
    from tests.support import hf_reference, mixed_cases

    cases = [c for c in mixed_cases() if c.conversation is not None]
    return cases, hf_reference(tiny_dir, processors["tiny"], cases, torch.float32)


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def emulated_dir(tmp_path_factory):
    """LLaVA-1.5-7B's config, tokenizer and processor without weights: what the emulated backend runs on."""
    return make_tiny_model(
        tmp_path_factory.mktemp("models") / "llava-1.5-7b", TinySpec(preset="llava-1.5-7b", config_only=True)
    )
