import os
import subprocess
import sys

import pytest

from bench.soak import MIX, REFUSED, _judge, body_of, mesh_processes, plan, rss_mib, slope_per_1000


def test_the_mix_is_the_same_for_a_seed_and_holds_every_kind():
    a, b = plan(400, seed=3), plan(400, seed=3)
    assert a == b and a != plan(400, seed=4)
    assert {kind for kind, _ in a} == set(MIX)
    assert all(4 <= max_tokens <= 32 for _, max_tokens in a)


def test_refused_kinds_must_be_a_400_and_the_rest_a_200():
    assert _judge("bad-image", 400, "") == ("refused", None)
    assert _judge("too-long", 500, "boom")[0] == "failed"
    assert _judge("text-whole", 200, "") == ("ok", None)
    assert _judge("image-stream", 503, "busy")[0] == "failed"
    assert REFUSED <= set(MIX)


def test_a_too_long_body_is_longer_than_the_model_and_a_bad_image_is_not_an_image():
    long = body_of("too-long", 8, 0, max_model_len=64)["messages"][0]["content"][-1]["text"]
    assert len(long.split()) > 64
    bad = body_of("bad-image", 8, 1, max_model_len=64)["messages"][0]["content"][0]["image_url"]["url"]
    assert bad.startswith("data:image/png;base64,") and not body_of("bad-image", 8, 1, 64)["stream"]
    assert body_of("leave-stream", 8, 2, 64)["stream"]


def test_the_slope_is_mib_per_thousand_requests():
    assert slope_per_1000([(0, 100.0), (500, 105.0), (1000, 110.0)]) == 10.0
    assert slope_per_1000([(0, 100.0), (1000, 100.0)]) == 0.0


def test_the_processes_under_a_serve_are_found_and_measured():
    port = "45678"  # only a marker in the command line: nothing listens on it
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "print(c.pid, flush=True); time.sleep(30)",
            "serve",
            "--port",
            port,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = int(parent.stdout.readline())
        found = mesh_processes(int(port))
        assert set(found) == {parent.pid, child}
        assert found[parent.pid] == "serve"
        assert rss_mib(os.getpid()) > 1
    finally:
        parent.kill()
        parent.wait()
        if child is not None:
            os.kill(child, 9)


def test_kills_are_read_as_role_at_a_request_count():
    from bench.soak import num_workers, parse_kills

    assert parse_kills(["d@500", "P@1200", "EP@500"], 2000) == {500: ["D", "EP"], 1200: ["P"]}
    for bad in (["D"], ["D@0"], ["D@2000"], ["@5"], ["D@x"]):
        with pytest.raises(ValueError, match="ROLE@N"):
            parse_kills(bad, 2000)
    assert num_workers("E1+P2+D2") == 5 and num_workers("EP4+D4") == 8 and num_workers("local") == 1


def test_the_report_names_the_backend_the_workers_ran():
    from bench.soak import BACKEND, backend_of

    assert backend_of([]) == BACKEND and backend_of(["--enable-prefix-caching"]) == BACKEND
    assert backend_of(["--backend", "emulated", "--profile", "H20"]).startswith("emulated (profile H20")
    assert backend_of(["--backend", "torch"]) == BACKEND
    assert backend_of(["--backend=emulated", "--profile=H100"]).startswith("emulated (profile H100")


def test_an_image_chat_sent_again_is_the_same_chat_and_one_of_a_few():
    a, b = body_of("image-again", 8, 3, 64), body_of("image-again", 8, 7, 64)  # 3 and 7: the same of the 4 chats
    assert a["messages"] == b["messages"] != body_of("image-again", 8, 4, 64)["messages"]
    assert a["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
