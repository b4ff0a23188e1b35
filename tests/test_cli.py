"""The CLI turns a latency profile and SLO targets into the engine's stage budgets."""

import pytest

from common.latency.budgets import budgets_for
from common.latency.roofline import analytic_profile
from epdmesh.cli import _engine_config, build_parser


def config_for(*argv):
    args = build_parser().parse_args(["worker", "--model", "/nowhere", *argv])
    return _engine_config(args, args.roles).scheduler


def test_budgets_come_from_the_profile_and_the_slos(tmp_path):
    path = tmp_path / "h100.json"
    analytic_profile("H100").save(path)
    prefill = config_for("--roles", "encode,prefill", "--latency-profile", str(path), "--slo-ttft-ms", "400",
                         "--slo-tbt-ms", "50")
    expected = budgets_for(analytic_profile("H100"), False, 400, 50)  # limit α·TTFT = 200 ms
    assert (prefill.token_budget, prefill.image_budget) == (expected.token_budget, expected.image_budget)
    decode = config_for("--roles", "decode", "--latency-profile", str(path), "--slo-ttft-ms", "400", "--slo-tbt-ms", "50")
    expected = budgets_for(analytic_profile("H100"), True, 400, 50)  # limit TBT = 50 ms
    assert (decode.token_budget, decode.image_budget) == (expected.token_budget, expected.image_budget)
    assert decode.token_budget < prefill.token_budget  # a decode instance keeps its iterations short
    explicit = config_for("--roles", "decode", "--latency-profile", str(path), "--token-budget", "99")
    assert explicit.token_budget == 99
    plain = config_for("--roles", "decode")
    assert (plain.token_budget, plain.image_budget) == (2048, 4)


def test_emulated_defaults_and_routing_choice(tmp_path):
    from epdmesh.cli import _kv_cache_gib

    args = build_parser().parse_args(["worker", "--backend", "emulated"])
    assert _kv_cache_gib(args) == 64.0  # an H20-sized cache, counted in the model's real page bytes
    assert _kv_cache_gib(build_parser().parse_args(["worker"])) == 1.0
    assert _kv_cache_gib(build_parser().parse_args(["worker", "--kv-cache-gib", "3"])) == 3.0
    toggle = build_parser().parse_args(["toggle", "--routing", "slo"])
    with pytest.raises(SystemExit, match="--latency-profile"):  # SLO routing without a profile refuses to start
        toggle.func(toggle)
