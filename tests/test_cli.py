"""The CLI turns a latency profile and SLO targets into the engine's stage budgets."""

import pytest

from common.latency import LatencyProfile
from common.latency.budgets import budgets_for
from common.latency.roofline import analytic_profile
from epdmesh.cli import build_parser, main
from epdmesh.engine_setup import engine_config


def config_for(*argv):
    args = build_parser().parse_args(["worker", "--model", "/nowhere", *argv])
    return engine_config(args, args.roles).scheduler


def test_budgets_come_from_the_profile_and_the_slos(tmp_path):
    path = tmp_path / "h100.json"
    analytic_profile("H100").save(path)
    prefill = config_for(
        "--roles", "encode,prefill", "--latency-profile", str(path), "--slo-ttft-ms", "400", "--slo-tbt-ms", "50"
    )
    expected = budgets_for(analytic_profile("H100"), False, 400, 50)  # limit α·TTFT = 200 ms
    assert (prefill.token_budget, prefill.image_budget) == (expected.token_budget, expected.image_budget)
    decode = config_for(
        "--roles", "decode", "--latency-profile", str(path), "--slo-ttft-ms", "400", "--slo-tbt-ms", "50"
    )
    expected = budgets_for(analytic_profile("H100"), True, 400, 50)  # limit TBT = 50 ms
    assert (decode.token_budget, decode.image_budget) == (expected.token_budget, expected.image_budget)
    assert decode.image_token_cost == expected.image_token_cost > 0
    assert decode.token_budget < prefill.token_budget  # a decode instance keeps its iterations short
    explicit = config_for("--roles", "decode", "--latency-profile", str(path), "--token-budget", "99")
    assert (explicit.token_budget, explicit.image_token_cost) == (99, 0)  # a given τ_t is the user's: no cost
    plain = config_for("--roles", "decode")
    assert (plain.token_budget, plain.image_budget, plain.image_token_cost) == (2048, 4, 0)
    joined = config_for(
        "--roles", "prefill,decode", "--latency-profile", str(path), "--slo-tbt-ms", "50", "--decoder-joins", "on"
    )
    assert joined.token_budget == budgets_for(analytic_profile("H100"), True, 2000, 50, joins=True).token_budget
    assert joined.token_budget < budgets_for(analytic_profile("H100"), True, 2000, 50).token_budget
    assert not joined.join_first
    first = config_for(
        "--roles", "prefill,decode", "--latency-profile", str(path), "--slo-tbt-ms", "150", "--decoder-joins", "first"
    )
    assert (
        first.join_first
        and first.token_budget
        == budgets_for(analytic_profile("H100"), True, 2000, 150, joins=True, join_first=True).token_budget
    )
    shorter = config_for(
        "--roles", "encode,prefill", "--latency-profile", str(path), "--slo-ttft-ms", "400", "--budget-alpha", "0.25"
    )  # limit α·TTFT = 100 ms
    assert shorter.token_budget == budgets_for(analytic_profile("H100"), False, 400, 50, alpha=0.25).token_budget
    assert shorter.token_budget < prefill.token_budget


def test_a_budget_that_cannot_fit_is_named_in_the_warning(tmp_path, caplog):
    from common.latency.roofline import QWEN2_VL_7B_1344

    path = tmp_path / "qwen.json"
    heavy = analytic_profile("H20", QWEN2_VL_7B_1344)  # an image's encode ~253 ms: over a 100 ms TBT, under 500 ms
    heavy.save(path)
    slos = ("--latency-profile", str(path), "--slo-ttft-ms", "1000", "--slo-tbt-ms", "100")
    assert budgets_for(heavy, True, 1000, 100).tokens_fit and not budgets_for(heavy, True, 1000, 100).images_fit
    with caplog.at_level("WARNING", logger="epdmesh"):
        config_for("--roles", "encode,prefill,decode", *slos)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("one image's encode (253 ms) exceeds the 100 ms limit") and "slow gap" in warning
    assert "cannot be met" not in warning  # prompts still fit: only the iterations that encode run long
    caplog.clear()
    with caplog.at_level("WARNING", logger="epdmesh"):
        config_for("--roles", "encode,prefill", *slos)  # α·TTFT = 500 ms: an image fits
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        config_for("--roles", "encode,prefill,decode", "--latency-profile", str(path), "--slo-tbt-ms", "1")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == "even one prompt token's iteration exceeds the 1 ms limit on this profile: the SLOs cannot be met"


def test_serve_passes_its_routing_policy_to_toggle_and_gateway_alike():
    from epdmesh.options import router_argv, routing_policy

    args = build_parser().parse_args(
        [
            "serve",
            "--latency-profile",
            "H20",
            "--slo-tbt-ms",
            "150",
            "--admission-control",
            "--decoder-joins",
            "on",
            "--budget-headroom",
            "0.8",
            "--budget-alpha",
            "0.3",
            "--prefill-mode",
            "dedicated",
            "--multiplex-max-tokens",
            "300",
            "--routing",
            "slo",
            "--slo-ttft-ms",
            "900",
        ]
    )  # none at its default
    argv = router_argv(args, args.latency_profile)
    toggle = build_parser().parse_args(["toggle", *argv])
    gateway = build_parser().parse_args(["gateway", "--toggle", "127.0.0.1:1", *argv])
    fields = (
        "prefill_mode",
        "multiplex_max_tokens",
        "routing",
        "slo_ttft_ms",
        "slo_tbt_ms",
        "latency_profile",
        "admission_control",
    )
    assert [getattr(toggle, f) for f in fields] == [getattr(gateway, f) for f in fields]
    # every option reaches them as serve was given it (an option router_argv forgot would fall back to its default)
    assert [getattr(gateway, f) for f in fields] == [getattr(args, f) for f in fields]
    assert (gateway.latency_profile, gateway.admission_control, gateway.slo_tbt_ms) == ("H20", True, 150)
    # the stage budgets are the workers' own (they register them): a router is given none to derive
    assert not any(hasattr(gateway, f) for f in ("budget_headroom", "budget_alpha", "decoder_joins", "worker_budgets"))
    assert routing_policy(gateway)[1].config.short_prompt_tokens == 300


def test_a_worker_registers_the_stage_budgets_it_runs():
    from common.workers import registered_budgets

    for joins in ("first", "on"):
        args = build_parser().parse_args(
            [
                "worker",
                "--model",
                "/nowhere",
                "--roles",
                "prefill,decode",
                "--latency-profile",
                "H20",
                "--slo-tbt-ms",
                "150",
                "--decoder-joins",
                joins,
            ]
        )
        info = registered_budgets(engine_config(args, args.roles).scheduler)
        expected = budgets_for(analytic_profile("H20"), True, 2000, 150, joins=True, join_first=joins == "first")
        assert (info["token_budget"], info["image_budget"], info["join_first"]) == (
            expected.token_budget,
            expected.image_budget,
            joins == "first",
        )


@pytest.mark.parametrize("flag, on", [([], True), (["--no-gap-slack"], False), (["--gap-slack"], True)])
def test_gap_slack_is_on_by_default_and_serve_hands_the_choice_to_its_workers(flag, on):
    from common.topology import parse_topology
    from epdmesh.launch import worker_argv

    common = ["--model", "/nowhere", "--latency-profile", "H20", "--slo-tbt-ms", "50", *flag]
    serve = build_parser().parse_args(["serve", "--topology", "EPD1", *common])
    argv = worker_argv(parse_topology("EPD1")[0], "127.0.0.1:1", serve, 1)
    assert ("--no-gap-slack" in argv) is not on and ("--gap-slack" in argv) is on
    worker = build_parser().parse_args(["worker", "--roles", "encode,prefill,decode", *common, *flag])
    assert (engine_config(worker, worker.roles).scheduler.gap_slack is not None) is on


@pytest.mark.parametrize("flag, gib", [([], 0.25), (["--image-cache-gib", "0.5"], 0.5)])
def test_serve_hands_its_image_cache_size_to_every_worker(flag, gib):
    from common.topology import parse_topology
    from epdmesh.launch import worker_argv

    serve = build_parser().parse_args(["serve", "--topology", "E1+P1+D1", "--model", "/nowhere", *flag])
    for spec in parse_topology("E1+P1+D1"):
        argv = worker_argv(spec, "127.0.0.1:1", serve, 1)
        worker = build_parser().parse_args(argv[argv.index("worker") :])
        assert engine_config(worker, worker.roles).image_cache_gib == gib


@pytest.mark.parametrize("option", ["amx-tiles", "prompt-kernel"])
@pytest.mark.parametrize("off", [False, True])
def test_cpu_kernels_are_on_by_default_and_serve_hands_the_choice_to_its_workers(option, off):
    from common.topology import parse_topology
    from epdmesh.launch import worker_argv

    flag = [f"--no-{option}"] if off else []
    serve = build_parser().parse_args(["serve", "--topology", "E1+P1+D1", "--model", "/nowhere", *flag])
    for spec in parse_topology("E1+P1+D1"):
        assert (f"--no-{option}" in worker_argv(spec, "127.0.0.1:1", serve, 1)) is off
    worker = build_parser().parse_args(["worker", "--roles", "decode", "--model", "/nowhere", *flag])
    assert getattr(engine_config(worker, worker.roles), option.replace("-", "_")) is not off


def test_emulated_defaults_and_routing_choice(tmp_path):
    from epdmesh.engine_setup import kv_cache_gib

    args = build_parser().parse_args(["worker", "--backend", "emulated"])
    assert kv_cache_gib(args) == 64.0  # an H20-sized cache, counted in the model's real page bytes
    assert kv_cache_gib(build_parser().parse_args(["worker"])) == 1.0
    assert kv_cache_gib(build_parser().parse_args(["worker", "--kv-cache-gib", "3"])) == 3.0
    toggle = build_parser().parse_args(["toggle", "--routing", "slo"])
    with pytest.raises(SystemExit, match="--latency-profile"):  # SLO routing without a profile refuses to start
        toggle.func(toggle)


def test_epdmesh_debug_turns_named_loggers_to_debug(monkeypatch):
    import logging

    from epdmesh.cli import main

    monkeypatch.setenv("EPDMESH_DEBUG", "epdmesh.iterations, epdmesh.test-probe")
    for name in ("epdmesh.iterations", "epdmesh.test-probe"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    assert main(["bench"]) == 2  # a usage error: returns at once, after the logging is set up
    try:
        assert logging.getLogger("epdmesh.iterations").level == logging.DEBUG
        assert logging.getLogger("epdmesh.test-probe").level == logging.DEBUG
        assert logging.getLogger("epdmesh.engine").getEffectiveLevel() > logging.DEBUG
    finally:
        for name in ("epdmesh.iterations", "epdmesh.test-probe"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_serve_and_worker_commit_a_real_engines_caches_on_the_cpu_only():
    def commits(*argv):
        args = build_parser().parse_args(["worker", "--model", "/nowhere", *argv])
        return engine_config(args, args.roles).commit_caches

    assert commits() and commits("--roles", "encode")
    assert not commits("--backend", "emulated")  # its caches stand for a GPU's: no host memory to fault in
    assert not commits("--device", "cuda")


def test_enforce_eager_turns_the_decode_cuda_graphs_off_as_it_does_compilation():
    def config(*argv):
        args = build_parser().parse_args(["worker", "--model", "/nowhere", "--device", "cuda", *argv])
        return engine_config(args, args.roles)

    assert config("--no-enforce-eager").cuda_graphs and not config("--no-enforce-eager").compile  # CUDA: no compile
    assert not config("--enforce-eager").cuda_graphs


@pytest.mark.parametrize(
    "flag, value, reason",
    [
        ("--profile", "H20:llava-2", "unknown model shape 'llava-2'"),
        ("--profile", "/nowhere/profile.json", "No such file"),
        ("--latency-profile", "B200", "No such file"),
    ],
)
def test_a_profile_that_does_not_load_is_a_usage_error_with_the_reason(flag, value, reason, capsys):
    argv = ["serve", "--backend", "emulated", flag, value]
    assert getattr(build_parser().parse_args(argv), flag[2:].replace("-", "_")) == value  # argv for elsewhere parses
    with pytest.raises(SystemExit) as stop:
        main(argv)  # but does not run here
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument {flag}: {value}: " in err and reason in err


def test_profiles_name_an_accelerator_and_optionally_a_model_shape():
    args = build_parser().parse_args(["serve", "--backend", "emulated", "--profile", "h100:qwen2-vl-7b-1344"])
    assert args.profile == "h100:qwen2-vl-7b-1344"
    from common.latency.roofline import load_profile

    assert load_profile(args.profile).name == "qwen2-vl-7b-1344 on H100 (analytic roofline)"


def test_an_analytic_profile_with_an_earlier_prefill_saturation_is_written_and_named(tmp_path, capsys):
    out = tmp_path / "h20-s256.json"
    assert main(["profile", "--analytic", "H20", "--prefill-saturation", "256", "--out", str(out)]) == 0
    from common.latency.roofline import load_profile

    assert LatencyProfile.load(out) == load_profile("H20", prefill_saturation=256)
    assert "prefill saturating at 256 tokens" in capsys.readouterr().out
    for argv in (["--prefill-saturation", "256"], ["--analytic", "H20", "--prefill-saturation", "0"]):
        with pytest.raises(SystemExit, match="applies to --analytic profiles only"):
            main(["profile", *argv, "--out", str(out)])
    with pytest.raises(SystemExit, match="cannot saturate at 20 tokens"):
        main(["profile", "--analytic", "H20", "--prefill-saturation", "20", "--out", str(out)])


@pytest.mark.parametrize(
    "topology, hold, nothing",
    [("E1+P1+D1", True, False), ("EP3+EPD1", True, False), ("EPD2", True, True), ("local", True, True)]
    + [("EPD2", False, False)],
)
def test_first_token_hold_is_said_to_hold_nothing_where_no_request_is_handed_over(topology, hold, nothing):
    from epdmesh.cli import nothing_held

    args = build_parser().parse_args(["serve", "--topology", topology, *(["--first-token-hold"] if hold else [])])
    assert nothing_held(args) is nothing
    gateway = build_parser().parse_args(["gateway", "--toggle", "127.0.0.1:1", "--first-token-hold"])
    assert gateway.first_token_hold and not build_parser().parse_args(["serve"]).first_token_hold
