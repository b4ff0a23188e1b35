"""serve's own latency profile: measured once per setup into the user's cache, then reused."""

import argparse
import json
import subprocess

import pytest

from epdmesh.auto_profile import ensure_profile, profile_path, setup_key, wants_auto_profile


def serve_args(model, **kw):
    base = dict(
        model=str(model),
        dtype="float32",
        device="cpu",
        enforce_eager=True,
        auto_profile=True,
        backend="torch",
        latency_profile=None,
        token_budget=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_a_setup_is_profiled_once_and_its_profile_reused(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EPDMESH_HOME", str(tmp_path))
    path = ensure_profile(serve_args(tiny_dir), threads=1)
    profile = json.loads(open(path).read())
    assert profile["prefill"] and profile["decode"] and profile["encode"]  # measured stage costs
    assert path.startswith(str(tmp_path / "profiles")) and "float32-1t" in path

    def no_measuring(*a, **kw):
        raise AssertionError("a cached setup was measured again")

    monkeypatch.setattr(subprocess, "run", no_measuring)
    assert ensure_profile(serve_args(tiny_dir), threads=1) == path
    with pytest.raises(AssertionError, match="measured again"):  # another thread count is another setup
        ensure_profile(serve_args(tiny_dir), threads=2)


def test_the_key_holds_what_a_profile_depends_on(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EPDMESH_HOME", str(tmp_path))
    key = setup_key(str(tiny_dir), "float32", "cpu", 1, True)
    assert {"model", "files", "dtype", "device", "threads", "eager", "cpu", "torch", "engine"} <= set(key)
    paths = {
        profile_path(setup_key(str(tiny_dir), *v))
        for v in [
            ("float32", "cpu", 1, True),
            ("bfloat16", "cpu", 1, True),
            ("float32", "cpu", 2, True),
            ("float32", "cpu", 1, False),
        ]
    }
    assert len(paths) == 4
    # the engine's compute code is part of the setup: a faster kernel is measured again
    monkeypatch.setattr("epdmesh.auto_profile.ENGINE_SOURCES", ("kernels/*.py",))
    assert setup_key(str(tiny_dir), "float32", "cpu", 1, True)["engine"] != key["engine"]


def test_only_serve_without_a_profile_or_budgets_measures(tiny_dir):
    assert wants_auto_profile(serve_args(tiny_dir))
    assert not wants_auto_profile(serve_args(tiny_dir, auto_profile=False))
    assert not wants_auto_profile(serve_args(tiny_dir, latency_profile="H20"))
    assert not wants_auto_profile(serve_args(tiny_dir, token_budget=512))
    assert not wants_auto_profile(serve_args(tiny_dir, backend="emulated"))


def test_a_profile_measured_on_a_busy_host_serves_its_run_but_is_not_kept(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EPDMESH_HOME", str(tmp_path))
    monkeypatch.setattr("epdmesh.auto_profile._others_share", lambda before, after: 0.6)
    path = ensure_profile(serve_args(tiny_dir), threads=1)
    assert path.endswith(".busy.json") and json.loads(open(path).read())["prefill"]
    key = setup_key(str(tiny_dir), "float32", "cpu", 1, True)
    assert not profile_path(key).exists()

    def measured(*a, **kw):
        raise RuntimeError("measured again")

    monkeypatch.setattr(subprocess, "run", measured)
    with pytest.raises(RuntimeError, match="measured again"):  # the next start does not take the busy one
        ensure_profile(serve_args(tiny_dir), threads=1)


def test_the_share_of_the_host_that_went_to_other_processes():
    from epdmesh.auto_profile import _cpu_seconds, _others_share

    cores = __import__("os").cpu_count()
    # 10 s of wall time: the host busy 12 s of CPU, 4 of them the profiler's own
    assert _others_share((0.0, 100.0, 1.0), (10.0, 112.0, 5.0)) == pytest.approx(8 / (10 * cores))
    assert _others_share((0.0, 100.0, 1.0), (10.0, 103.0, 5.0)) == 0.0  # ticks' rounding: never below zero
    assert _others_share(None, (1.0, 2.0, 3.0)) == 0.0  # not readable: taken as quiet
    now = _cpu_seconds()
    assert now is None or (len(now) == 3 and now[1] > 0)
