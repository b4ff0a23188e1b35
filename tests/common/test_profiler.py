"""`epdmesh profile`'s sweep on the real engine gives a usable, monotone latency profile."""

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.profiler import Profiler, _fit
from common.latency import LatencyProfile, decode_ms, encode_ms, prefill_ms
from common.scheduler import SchedulerConfig


def test_fit_is_least_squares_without_negative_terms():
    assert [round(c, 6) for c in _fit([[1, x] for x in (1, 2, 3, 4)], [5, 7, 9, 11])] == [3.0, 2.0]
    # a negative slope is not allowed: the best fit keeps the intercept only
    assert [round(c, 6) for c in _fit([[1, x] for x in (1, 2, 3)], [3, 2, 1])] == [2.0, 0.0]


def test_profiler_sweeps_the_engine(tiny_dir, tmp_path):
    config = EngineConfig(
        model=str(tiny_dir),
        kv_cache_gib=0.02,
        image_cache_gib=0.02,
        scheduler=SchedulerConfig(token_budget=1 << 12, image_budget=8, max_num_seqs=32),
    )
    steps = []
    profiler = Profiler(Engine(config), repeats=1, progress=steps.append)
    profiler.encode([1, 2])
    profiler.prefill([16, 64])
    profiler.decode([1, 2], [32])
    transfer = profiler.transfer(8)
    profile = profiler.profile("tiny here", "cpu", "tiny", transfer)
    assert steps == ["encode 1", "encode 2", "prefill 16", "prefill 64", "decode 1x32", "decode 2x32", "transfer"]
    assert [p[0] for p in profiler.points["encode"]] == [1, 2] and len(profiler.points["decode"]) == 2
    assert all(ms > 0 for *_, ms in profiler.points["prefill"] + profiler.points["decode"] + profiler.points["encode"])
    assert profile.source == "measured" and profile.image_tokens == 256 and profile.transfer_gbps > 0
    assert 0 < encode_ms(profile, 1) <= encode_ms(profile, 2)
    assert 0 < prefill_ms(profile, 16) <= prefill_ms(profile, 64)
    assert 0 < decode_ms(profile, 1, 33) <= decode_ms(profile, 2, 66)
    profile.save(tmp_path / "p.json")
    assert LatencyProfile.load(tmp_path / "p.json") == profile
    engine = profiler.engine
    assert not engine.has_unfinished and engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
