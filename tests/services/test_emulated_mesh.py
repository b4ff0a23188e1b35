"""The emulated backend behind the real mesh: same tokens on every topology (pages really move), each worker
registering the stage budgets it runs, and the goodput benchmark's smoke run against it."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from bench import goodput
from bench.workloads import SHAPES, request_bodies
from common.latency.budgets import budgets_for
from common.latency.roofline import load_profile
from sim.goodput import main as sim_goodput
from tests.services.servers import MODEL, assert_pools_full, running_server

H20 = str(Path(__file__).resolve().parents[2] / "profiles" / "llava-1.5-7b-h20.json")


def test_emulated_meshes_agree_and_the_goodput_benchmark_measures_one(emulated_dir, tmp_path):
    bodies = [
        {k: v for k, v in b.items() if k not in ("stream", "stream_options")}
        for b in request_bodies(SHAPES["textcaps"], 4, MODEL, seed=3)
    ]
    answers = {}
    for topology in ("EPD1", "E1+P1+D1"):
        log = tmp_path / f"{topology.replace('+', '_')}.log"
        with running_server(
            emulated_dir,
            topology,
            log,
            "--backend",
            "emulated",
            "--profile",
            H20,
            "--kv-cache-gib",
            "4",
            "--transfer",
            "grpc",
            "--latency-profile",
            H20,
            "--slo-ttft-ms",
            "2000",
            "--slo-tbt-ms",
            "150",
            *(("--first-token-hold",) if topology == "E1+P1+D1" else ()),  # the handover's gap hidden (below)
        ) as base:
            replies = [httpx.post(f"{base}/v1/chat/completions", json=b, timeout=60).json() for b in bodies]
            answers[topology] = [
                (r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]) for r in replies
            ]
            assert all(r["usage"]["prompt_tokens"] > 576 for r in replies)  # 576 image tokens of LLaVA-1.5-7B
            if topology == "E1+P1+D1":
                # each worker registered the budgets it runs (routers read them there): τ_t as given (running_server's
                # --token-budget 256), τ_e derived from the profile and the SLOs
                workers = httpx.get(f"{base}/stats", timeout=30).json()["workers"].values()
                for has_decode, roles in ((False, "E"), (False, "P"), (True, "D")):
                    expected = budgets_for(load_profile(H20), has_decode, 2000, 150).image_budget
                    assert [
                        (w["token_budget"], w["image_budget"], w["join_first"]) for w in workers if w["roles"] == roles
                    ] == [(256, expected, False)]
                # --first-token-hold: the first token, from the prefill worker, goes out with the decoder's first
                # (without it, that gap is the KV pull and a decode iteration: no shorter than the later gaps)
                streamed = {**bodies[0], "stream": True, "return_token_ids": True}
                result = asyncio.run(_streamed(f"{base}/v1/chat/completions", streamed))
                assert result.ok and len(result.itl) == SHAPES["textcaps"].output_tokens - 1
                assert result.itl[0] < 0.5 * min(result.itl[1:]), result.itl
                held = [
                    float(line.split()[-1])
                    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
                    if line.startswith("epdmesh:first_token_hold_seconds_count")
                ]
                assert held and held[0] >= 1  # the answers here were handed over, and their first tokens held
                out = tmp_path / "goodput.json"
                sweep = ["--workload", "pope,conversation", "--rates", "2,50", "--num-prompts", "6", "--warmup", "1"]
                sweep += ["--pause", "0", "--slo-ttft-ms", "60000", "--slo-tbt-ms", "60000", "--profile", H20]
                assert goodput.main(["--url", base, "--backend", "emulated", *sweep, "--out", str(out)]) == 0
                report = json.loads(out.read_text())
                run = report["configs"]["mesh"]["pope"]
                assert [p["request_rate"] for p in run["points"]] == [2.0, 50.0]
                assert all(p["completed"] == 6 and p["slo_attainment"] == 1.0 for p in run["points"])
                assert run["goodput"] == 50.0 and report["backend"].startswith("emulated")
                assert [p["prefill_paths"]["dedicated"] for p in run["points"]] == [6, 6]  # E1+P1+D1: all on P
                for key in ("request_throughput", "request_goodput", "p90_ttft_ms", "median_itl_ms", "p99_e2el_ms"):
                    assert key in run["points"][0]
                chats = report["configs"]["mesh"]["conversation"]
                assert all(p["completed"] == 6 for p in chats["points"]) and len(chats["requests"]) == 6
                # the planned prompts are the server's, token for token; what its cache answered, an earlier
                # request of the window held
                assert {p["total_input_tokens"] for p in chats["points"]} == {sum(r[0] for r in chats["requests"])}
                assert all(p["total_cached_tokens"] <= sum(r[1] for r in chats["requests"]) for p in chats["points"])
                assert chats["points"][0]["total_cached_tokens"] > 0  # at 2 req/s the system prompt was cached by then
                assert out.with_suffix(".png").stat().st_size > 10_000
                # the simulator on the same sweep predicts this mesh, less what it leaves out: the host's own costs
                # (HTTP, gRPC, image decoding, three processes and the gateway on this host's cores; ~65 ms of TTFT
                # here at time ×1, a tenth of that at ×10, but 351 ms once in a full suite on a 2-core host): the
                # simulator accounts for most of the TTFT and never for more; the per-token gaps within 20%
                simulated = tmp_path / "simulated.json"
                config = f"mesh=--topology E1+P1+D1 --kv-cache-gib 4 --token-budget 256 --latency-profile {H20}"
                config += " --first-token-hold"
                assert (
                    sim_goodput([*sweep, "--model", str(emulated_dir), "--config", config, "--out", str(simulated)])
                    == 0
                )
                predicted = json.loads(simulated.read_text())["configs"]["mesh"]
                for workload in ("pope", "conversation"):
                    real, sim = report["configs"]["mesh"][workload]["points"][0], predicted[workload]["points"][0]
                    host_ms = real["median_ttft_ms"] - sim["median_ttft_ms"]  # at 2 req/s: no queue to amplify it
                    # (here: 37 and 32 ms of 226 and 301; a share, since one stall of this host moves the median)
                    assert 0 < host_ms < 0.6 * real["median_ttft_ms"], (workload, host_ms)
                    # the pace of the tokens: each request's mean gap, and on `conversation` the mean of all gaps.
                    # Not pope's gaps: its answers have three each, the first held to ~0 (--first-token-hold), and of
                    # its 18 gaps two tokens delivered together on a loaded host move the mean by ~15% (their median
                    # fell between the two kinds, 6.6 and 5.9 ms on the mesh against the simulator's 7.7, 2026-12-06;
                    # their mean 3.85 against 5.14 once in a full suite, 4.88 alone, 2026-12-07) — while each
                    # request's TPOT, which only its last token ends, agreed (5.17 against 5.14 ms)
                    for key in ("median_tpot_ms", "mean_itl_ms") if workload == "conversation" else ("median_tpot_ms",):
                        assert sim[key] == pytest.approx(real[key], rel=0.2), (workload, key)
            assert_pools_full(base)
    assert answers["EPD1"] == answers["E1+P1+D1"]
    assert {n for _, n in answers["EPD1"]} == {SHAPES["textcaps"].output_tokens}
    assert len({text for text, _ in answers["EPD1"]}) == len(bodies)  # other images, other answers


async def _streamed(url: str, body: dict) -> goodput.Result:
    async with httpx.AsyncClient(timeout=60) as client:
        return await goodput.send(client, url, body, 1.0)
