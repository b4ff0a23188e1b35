"""One read-only copy of the weights for every worker on a host: the same tokens, one file, removed by the last."""

import logging

import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.model import shared_weights
from common.model.loader import load_model
from common.request import Request
from common.sampling import SamplingParams


def tokens(tiny_dir, model, ids):
    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01), model=model)
    return engine.generate([Request("r", ids, SamplingParams(max_tokens=12, temperature=0))])["r"].output_token_ids


def test_two_models_map_one_file_give_the_private_tokens_and_the_last_to_close_removes_it(
    tiny_dir, processors, tmp_path
):
    ids = processors["tiny"].apply([{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}])[0]
    private = tokens(tiny_dir, load_model(tiny_dir), ids)
    a, b = load_model(tiny_dir), load_model(tiny_dir)
    first = shared_weights.share(a, str(tiny_dir), torch.float32, directory=str(tmp_path))
    (path,) = [p for p in tmp_path.iterdir() if not p.name.endswith((".lock", ".users"))]
    written = path.stat().st_mtime_ns
    second = shared_weights.share(b, str(tiny_dir), torch.float32, directory=str(tmp_path))
    assert first.path == second.path == path and path.stat().st_mtime_ns == written  # written once, then mapped
    assert len({p.untyped_storage().data_ptr() for p in a.parameters()}) == 1  # all views of the one mapping
    assert tokens(tiny_dir, a, ids) == tokens(tiny_dir, b, ids) == private
    first.close()
    assert path.exists()  # the other still maps it
    second.close()
    assert not path.exists() and [p.suffix for p in tmp_path.iterdir()] == [".lock"]  # an empty lock file stays


def test_weights_stay_private_without_room_or_with_a_file_that_is_not_this_checkpoints(
    tiny_dir, tmp_path, monkeypatch, caplog
):
    model = load_model(tiny_dir)
    before = [p.data_ptr() for p in model.parameters()]
    with monkeypatch.context() as m:
        m.setattr(shared_weights.shutil, "disk_usage", lambda _: type("U", (), {"free": 1 << 20})())
        assert shared_weights.share(model, str(tiny_dir), torch.float32, directory=str(tmp_path)) is None
    other = load_model(tiny_dir)
    shared = shared_weights.share(other, str(tiny_dir), torch.float32, directory=str(tmp_path))
    path = shared.path
    shared.close()
    total = sum(shared_weights._aligned(p.numel() * p.element_size()) for p in model.parameters())
    path.write_bytes(bytes(total))  # the right size, the wrong bytes (torn, or another checkpoint's)
    with caplog.at_level(logging.WARNING, logger="common.model.shared_weights"):
        assert shared_weights.share(model, str(tiny_dir), torch.float32, directory=str(tmp_path)) is None
    assert "does not hold this checkpoint" in caplog.text
    assert [p.data_ptr() for p in model.parameters()] == before  # untouched


def test_an_engine_asked_to_shares_its_weights(tiny_dir):
    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01, share_weights=True))
    try:
        assert engine.shared_weights is not None and engine.shared_weights.path.exists()
    finally:
        engine.shared_weights.close()
    assert Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01)).shared_weights is None
