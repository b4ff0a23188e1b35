"""The simulator (`sim/`): a request's times are the latency profile's, as the emulated engine would take them; the
routing is the live router's; the goodput command writes the benchmark's report."""

import dataclasses
import json
import types
from pathlib import Path

import pytest

from bench.workloads import SHAPES, phased_bodies, request_bodies
from common.latency.model import iteration_ms
from common.latency.roofline import load_profile
from common.request import Stage
from sim.build import Setup
from sim.events import Loop
from sim.goodput import main as sim_goodput
from sim.goodput import run_point

H20 = str(Path(__file__).resolve().parents[2] / "profiles" / "llava-1.5-7b-h20.json")
SLO = types.SimpleNamespace(slo_ttft_ms=1000.0, slo_tbt_ms=100.0)


def setup_of(emulated_dir, topology: str, *extra: str) -> Setup:
    return Setup.of(
        [
            "--model",
            str(emulated_dir),
            "--topology",
            topology,
            "--backend",
            "emulated",
            "--profile",
            H20,
            "--slo-ttft-ms",
            "1000",
            "--slo-tbt-ms",
            "100",
            *extra,
        ]
    )


def prompts_of(setup: Setup, n: int, variant: int = 1):
    return [setup.prompt(b) for b in request_bodies(SHAPES["textcaps"], n, setup.model, seed=0, variant=variant)]


def test_the_loop_runs_its_callbacks_on_one_torch_thread_and_gives_the_threads_back():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen, loop = [], Loop()
        loop.at(0.5, lambda: seen.append(torch.get_num_threads()))
        loop.at(0.1, lambda: seen.append(loop.now))
        loop.run()
        assert seen == [0.1, 1] and loop.now == 0.5 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_request_alone_takes_the_profiles_times_through_encode_prefill_and_decode(emulated_dir):
    """E1+P1+D1, one request: its encode iteration, the image pages' transfer, its prefill iteration (the first
    token), the KV pages' transfer, then one decode iteration per token — each as long as the profile predicts."""
    setup = setup_of(emulated_dir, "E1+P1+D1")
    [prompt] = prompts_of(setup, 1)
    loop = Loop()
    mesh = setup.mesh(loop)
    timeline = mesh.submit(0.25, prompt)
    loop.run(until=lambda: mesh.unfinished == 0)
    profile, n = load_profile(H20), len(prompt.token_ids)
    engine = next(iter(mesh.workers.values())).engine
    first = (
        iteration_ms(profile, images=1) / 1e3
        + engine.transfer_delay_s("image", 576)
        + iteration_ms(profile, chunks=[(n, 0)]) / 1e3
    )
    assert timeline.error == "" and timeline.path.value == "dedicated"
    assert timeline.token_times[0] - timeline.arrival == pytest.approx(first)
    expected, at = [first], first + engine.transfer_delay_s("kv", n)
    for k in range(1, prompt.max_tokens):
        at += iteration_ms(profile, decodes=1, decode_context=n + k) / 1e3
        expected.append(at)
    assert [t - timeline.arrival for t in timeline.token_times] == pytest.approx(expected)
    assert all(w.engine.stats().kv_blocks_free == w.engine.stats().kv_blocks_total for w in mesh.workers.values())


def _alone(setup: Setup, prompt) -> list[float]:
    loop = Loop()
    mesh = setup.mesh(loop)
    timeline = mesh.submit(0.25, prompt)
    loop.run(until=lambda: mesh.unfinished == 0)
    assert timeline.error == ""
    return [t - timeline.arrival for t in timeline.token_times]


@pytest.mark.parametrize("topology", ["E1+P1+D1", "EPD1"])
def test_the_first_token_hold_sends_a_handed_over_first_token_with_its_second_or_at_its_end(emulated_dir, topology):
    """As the gateway holds it (`failover.held_first`): on path ① the first token goes out with the second, at most
    until 90% of the TTFT target; a colocated request is never held; the other tokens keep their times."""
    setup = setup_of(emulated_dir, topology)
    [prompt] = prompts_of(setup, 1)
    plain = _alone(setup, prompt)
    held = _alone(setup_of(emulated_dir, topology, "--first-token-hold"), prompt)
    if topology == "EPD1":
        assert held == plain
        return
    assert held == [plain[1], *plain[1:]] and plain[1] > plain[0]
    target_ms = 1e3 * (plain[0] + plain[1]) / 2 / 0.9  # the hold ends halfway between the two
    capped = _alone(setup_of(emulated_dir, topology, "--first-token-hold", "--slo-ttft-ms", str(target_ms)), prompt)
    assert capped == pytest.approx([(plain[0] + plain[1]) / 2, *plain[1:]])


def test_the_same_inputs_give_the_same_run_and_more_load_meets_fewer_slos(emulated_dir):
    setup = setup_of(emulated_dir, "EPD2", "--latency-profile", H20, "--routing", "slo")
    prompts = prompts_of(setup, 40)
    burst = [i * 0.01 for i in range(40)]  # 100 req/s on two instances: far past what they serve within SLO
    calm = [i * 1.0 for i in range(40)]
    a, b = run_point(setup, prompts, burst, 100.0, SLO), run_point(setup, prompts, burst, 100.0, SLO)
    keys = ("slo_attainment", "p90_ttft_ms", "p90_itl_ms", "prefill_paths", "sim_events")
    assert [a[k] for k in keys] == [b[k] for k in keys]
    quiet = run_point(setup, prompts, calm, 1.0, SLO)
    assert quiet["slo_attainment"] == 1.0 and quiet["failed"] == 0
    assert a["slo_attainment"] < 0.9 and a["completed"] == 40  # late, not lost
    assert quiet["prefill_paths"] == {"colocated": 40}


def test_the_pages_own_bytes_change_nothing_but_the_caches_size(emulated_dir, monkeypatch):
    """The simulator's emulated pages carry 8 / 4 bytes a token (`sim.build.PAGE_KV_BYTES`), not serve's 256 / 64:
    capacity and transfer times count the model's bytes, the tokens come from the stamps — a burst through a split
    mesh (page pulls, waits for room) runs the same at both sizes, on caches 32× smaller."""
    import sim.build

    setup = setup_of(emulated_dir, "E1+P1+D1", "--kv-cache-gib", "1")
    prompts, times = prompts_of(setup, 24), [i * 0.02 for i in range(24)]

    def run() -> tuple[list, int]:
        loop = Loop()
        mesh = setup.mesh(loop)
        timelines = [mesh.submit(at, p) for at, p in zip(times, prompts)]
        loop.run(until=lambda: mesh.unfinished == 0)
        caches = sum(w.engine.kv_cache.data.nbytes for w in mesh.workers.values())
        assert mesh.waited > 0  # (KV for ~2,048 tokens a worker: the burst waits at the gateway for room)
        return [(t.token_times, t.path, t.error) for t in timelines], caches

    small, small_bytes = run()
    monkeypatch.setattr(sim.build, "PAGE_KV_BYTES", 256)
    monkeypatch.setattr(sim.build, "PAGE_IMAGE_BYTES", 64)
    large, large_bytes = run()
    assert small == large and all(not error and len(times) == 32 for times, _, error in small)
    assert large_bytes == 32 * small_bytes


def test_a_burst_spreads_over_the_workers_before_any_heartbeat_reports_it(emulated_dir):
    """The router books each route on its workers at once (the live `RouteBook`): ten requests within one
    millisecond, long before a heartbeat, go to both instances."""
    setup = setup_of(emulated_dir, "EPD2")
    loop = Loop()
    mesh = setup.mesh(loop)
    for i, prompt in enumerate(prompts_of(setup, 10)):
        mesh.submit(1e-4 * i, prompt)
    loop.run(until=lambda: mesh.unfinished == 0)
    assert [w.iterations > 0 for w in mesh.workers.values()] == [True, True]
    assert sum(w.engine.scheduler.kv.num_queried_tokens > 0 for w in mesh.workers.values()) == 2


def test_a_burst_past_the_workers_kv_waits_at_the_gateway_for_room_and_every_request_completes(emulated_dir):
    """EP1+D1 with 2,048 tokens of KV each, twelve ~650-token requests at once: the router reserves each route's
    prompt on the prefill worker against what it last reported free (the Redis script's rule, `Ledger`) — never on
    the decoder, which takes the pages in as it has room — the rest wait at the gateway and route as room comes, in
    waves, none failed, and every reservation ends."""
    setup = setup_of(emulated_dir, "EP1+D1", "--kv-cache-gib", "1")
    loop = Loop()
    mesh = setup.mesh(loop)
    booked, reserve = [], mesh.reservations.reserve
    mesh.reservations.reserve = lambda rid, amounts, now: booked.append(sorted(amounts)) or reserve(rid, amounts, now)
    timelines = [mesh.submit(0.001 * i, p) for i, p in enumerate(prompts_of(setup, 12))]
    loop.run(until=lambda: mesh.unfinished == 0)
    assert all(t.error == "" and len(t.token_times) == 32 for t in timelines)
    ttfts = sorted(t.token_times[0] - t.arrival for t in timelines)
    assert mesh.waited > 0 and ttfts[0] < 0.5 < 1.5 < ttfts[-1]  # the last waited for three waves to finish
    assert booked and all(workers == [_prefill_worker(mesh)] for workers in booked)
    assert all(mesh.reservations.holds(w, float("-inf")) == 0 for w in mesh.workers)


def _prefill_worker(mesh) -> str:
    (worker,) = [w for w, sw in mesh.workers.items() if Stage.DECODE not in sw.info.roles]
    return worker


def test_a_request_its_only_decoder_hands_back_goes_on_there(emulated_dir):
    """Answers that outgrow the one decoder's KV: it preempts them and, their images elsewhere, hands them back;
    the gateway routes each again anywhere with room — that decoder too (a hand-back is not its failure) — and
    every request gets all its tokens."""
    setup = setup_of(emulated_dir, "EP1+D1", "--kv-cache-gib", "1")
    loop = Loop()
    mesh = setup.mesh(loop)
    prompts = [dataclasses.replace(p, max_tokens=700) for p in prompts_of(setup, 4)]
    timelines = [mesh.submit(0.001 * i, p) for i, p in enumerate(prompts)]
    loop.run(until=lambda: mesh.unfinished == 0)
    assert mesh.workers["d-0"].engine.stats().num_preemptions > 0
    assert [(t.error, len(t.token_times)) for t in timelines] == [("", 700)] * 4


def test_a_handed_back_request_routes_by_its_prefix_to_the_worker_holding_its_prompt_and_prefills_from_there(
    emulated_dir,
):
    """EP2+D1, answers that outgrow the one decoder's KV: each it hands back goes on as a continuation, routed with
    its own prefix fields as the gateway routes every attempt (`Prompts.prefix_of`): back to the prefill worker that
    holds its prompt, where the prompt's blocks come from the cache; the usage counts them, of the prompt alone."""
    setup = setup_of(emulated_dir, "EP2+D1", "--kv-cache-gib", "1")
    loop = Loop()
    mesh = setup.mesh(loop)
    prefilled_on, chosen = {}, mesh.book.chosen
    mesh.book.chosen = lambda plan, summary, now: (
        prefilled_on.setdefault(summary.request_id, plan.prefill.worker_id),
        chosen(plan, summary, now),
    )
    prompts = [dataclasses.replace(p, max_tokens=700) for p in prompts_of(setup, 4)]
    timelines = [mesh.submit(0.001 * i, p) for i, p in enumerate(prompts)]
    loop.run(until=lambda: mesh.unfinished == 0)
    firsts = [rid for rid in prefilled_on if "-m" not in rid]  # in arrival order
    again = {rid.split("-m")[0] for rid in prefilled_on if "-m" in rid}
    assert len(again) == 2 and all(prefilled_on[f"{rid}-m1"] == prefilled_on[rid] for rid in again)
    block = 16  # the last prompt token's block is computed again
    expected = [(len(p.token_ids) - 1) // block * block if rid in again else 0 for rid, p in zip(firsts, prompts)]
    assert [t.cached_tokens for t in timelines] == expected and [len(t.token_times) for t in timelines] == [700] * 4


def test_a_request_handed_back_as_a_step_begins_joins_the_next_step_of_the_worker_it_goes_back_to():
    """A worker's step hands a request back as it is planned (its decoder preempted it) and the request's next route
    sends work back to this worker at once (it is also the mesh's encoder): that work waits for the next step — a
    second step begun meanwhile planned the same request twice (seen: its images encoded twice, a crash)."""
    from sim.worker import SimWorker

    class Engine:  # the engine's step interface, recording how many steps are under way when one begins
        sleeps, clock, predicted_ms, has_unfinished = True, None, 10.0, True

        def __init__(self):
            self.under_way, self.seen, self.steps = 0, [], 0

        def begin_step(self):
            self.seen.append(self.under_way)
            self.steps += 1
            if self.steps > 3:
                self.has_unfinished = False
                return None, []
            self.under_way += 1
            return "plan", ["handed back"] if self.steps == 1 else []

        def execute_step(self, plan):
            return None, None

        def end_step(self, plan, sampling, tokens, ms):
            self.under_way -= 1
            return []

    engine, loop = Engine(), Loop()
    worker = SimWorker(loop, types.SimpleNamespace(worker_id="ed-0"), engine, deliver=lambda w, outputs: w.kick())
    worker.kick()
    loop.run(until=lambda: not engine.has_unfinished)
    assert engine.steps == 4 and engine.seen == [0, 0, 0, 0]  # one step at a time


def test_sim_goodput_writes_the_benchmarks_report_and_plot(emulated_dir, tmp_path):
    out = tmp_path / "sim.json"
    assert (
        sim_goodput(
            [
                "--model",
                str(emulated_dir),
                "--config",
                "E1+P1+D1=--topology E1+P1+D1",
                "--workload",
                "textcaps",
                "--rates",
                "1,200",
                "--num-prompts",
                "12",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["backend"].startswith("simulated")
    run = report["configs"]["E1+P1+D1"]["textcaps"]
    assert [p["request_rate"] for p in run["points"]] == [1.0, 200.0]
    assert run["points"][0]["slo_attainment"] == 1.0 and run["goodput"] >= 1.0
    assert run["points"][1]["slo_attainment"] < run["points"][0]["slo_attainment"]
    assert {"request_goodput", "p90_ttft_ms", "median_itl_ms", "sim_wall_s", "sim_speed"} <= set(run["points"][0])
    assert run["goodput_bound"] > 0 and out.with_suffix(".png").stat().st_size > 10_000


def test_the_planner_switches_a_toggles_workers_with_the_load_and_their_decodes_go_on_from_their_kv(emulated_dir):
    """EP3+EPD1 with the planner, long answers then pages: an EP worker becomes EPD while the answers decode, and
    back once the pages come; the decodes running on a switching decoder after the grace go on elsewhere from the
    KV pages it handed back (nothing prefilled again), and every request gets all its tokens once."""
    setup = setup_of(
        emulated_dir, "EP3+EPD1", "--routing", "slo", "--latency-profile", H20, "--max-num-seqs", "256",
        "--planner", "--planner-interval", "1", "--planner-max-switches", "1", "--planner-grace", "0.2",
    )  # fmt: skip
    bodies = phased_bodies([SHAPES["detail"], SHAPES["document"]], 240, setup.model)
    loop = Loop()
    mesh = setup.mesh(loop)
    timelines = [mesh.submit(0.05 * i, setup.prompt(body)) for i, body in enumerate(bodies)]
    loop.run(until=lambda: mesh.unfinished == 0)
    assert all(not t.error and len(t.token_times) == body["max_tokens"] for t, body in zip(timelines, bodies))
    switches = mesh.planner.switches
    moves = [(frm, to) for _, _, frm, to, _ in switches]
    assert moves[0] == ("EP", "EPD") and ("EPD", "EP") in moves, moves
    assert {label for label in (w.info.role_label for w in mesh.workers.values())} <= {"EP", "EPD"}
    handed = sum(n for *_, n in switches)  # (those not decoding yet are handed back without KV, and prefill again)
    assert 0 < mesh.planner.handed_with_kv <= handed and mesh.resumed == mesh.planner.handed_with_kv  # from their pages
    assert {d.action for _, d in mesh.planner.decisions} >= {"switch", "hold"}


def test_bench_shift_replays_its_load_in_the_simulator_with_the_planners_switches(emulated_dir, tmp_path):
    """`epdmesh bench shift --backend sim`: the benchmark's own sends and bodies on a simulated mesh — attainment per
    phase and window, the role sets sampled every window, the planner's switches — and the plot."""
    from bench.shift import main as shift

    out = tmp_path / "shift.json"
    tuned = "--routing slo --latency-profile {profile} --max-num-seqs 256"
    planner = "--planner --planner-interval 1 --planner-max-switches 1 --planner-grace 0.2"
    args = [
        "--backend", "sim", "--model", str(emulated_dir), "--rate", "20", "--window", "2", "--time-scale", "5",
        "--workload", "detail@6,document@5", "--planner-phase", "0.5",
        "--config", f"EP3+EPD1 planner=--topology EP3+EPD1 {tuned} {planner}",
        "--config", f"EP3+EPD1=--topology EP3+EPD1 {tuned}",
        "--out", str(out),
    ]  # fmt: skip
    assert shift(args) == 0
    report = json.loads(out.read_text())
    assert report["backend"].startswith("simulated") and report["planner_phase"] == 0.5
    moved, still = report["configs"]["EP3+EPD1 planner"], report["configs"]["EP3+EPD1"]
    assert moved["requests"] == still["requests"] > 150 and moved["failed"] == still["failed"] == 0
    assert [p["shape"] for p in moved["by_phase"]] == ["detail", "document"]
    assert moved["planner"] and {s["to"] for s in moved["planner"]} <= {"EP", "EPD"} and not still["planner"]
    assert len({tuple(s["roles"].items()) for s in moved["roles"]}) > 1  # the samples saw the role sets change
    assert {tuple(s["roles"].items()) for s in still["roles"]} == {(("EP", 3), ("EPD", 1))}
    assert out.with_suffix(".png").stat().st_size > 10_000
