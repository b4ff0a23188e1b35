"""The least-loaded routing policy as a pure function: exact choices on small snapshots."""

import pytest

from common.policy.routing import PrefillPath, RouteSummary, RoutingConfig, route
from common.request import Stage
from common.topology import decoders_join, parse_topology
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot

E, P, D = Stage.ENCODE, Stage.PREFILL, Stage.DECODE


def worker(wid, roles, age=0.0, **load):
    return WorkerSnapshot(WorkerInfo(wid, f"127.0.0.1:{1000 + len(wid)}", frozenset(roles)), WorkerLoad(**load), age)


def ask(tokens=100, images=1, max_tokens=16):
    return RouteSummary("r", tokens, images, max_tokens)


def ids(plan):
    return (plan.encoder.worker_id if plan.encoder else None, plan.prefill.worker_id, plan.decoder.worker_id, plan.path)


def test_colocated_worker_takes_every_stage():
    assert ids(route([worker("epd", {E, P, D})], ask(), RoutingConfig())) == (
        "epd",
        "epd",
        "epd",
        PrefillPath.COLOCATED,
    )


def test_split_mesh_uses_each_role():
    workers = [worker("e", {E}), worker("p", {P}), worker("d", {D})]
    assert ids(route(workers, ask(), RoutingConfig())) == ("e", "p", "d", PrefillPath.DEDICATED)
    assert ids(route(workers, ask(images=0), RoutingConfig())) == (None, "p", "d", PrefillPath.DEDICATED)


def test_encoder_is_the_prefill_worker_when_it_encodes():
    workers = [worker("e", {E}), worker("ep", {E, P}), worker("d", {D})]
    assert ids(route(workers, ask(), RoutingConfig())) == ("ep", "ep", "d", PrefillPath.DEDICATED)


def test_ed_plus_p_sends_images_to_the_prefill_worker_and_kv_back():
    workers = [worker("ed", {E, D}), worker("p", {P})]
    assert ids(route(workers, ask(), RoutingConfig())) == ("ed", "p", "ed", PrefillPath.DEDICATED)


def test_decoder_with_fewest_unfinished_tokens_wins_ties_by_id():
    workers = [
        worker("d1", {D}, unfinished_decode_tokens=50),
        worker("d2", {D}, unfinished_decode_tokens=10),
        worker("d3", {D}, unfinished_decode_tokens=10),
        worker("p", {P}),
    ]
    assert route(workers, ask(images=0), RoutingConfig()).decoder.worker_id == "d2"


def test_least_queued_prefill_and_encoder():
    workers = [
        worker("e1", {E}, num_waiting=3),
        worker("e2", {E}, num_running=1),
        worker("p1", {P}, num_running=2),
        worker("p2", {P}, num_waiting=1),
        worker("d", {D}),
    ]
    assert ids(route(workers, ask(), RoutingConfig()))[:2] == ("e2", "p2")


@pytest.mark.parametrize(
    "mode,tokens,path,prefill",
    [
        ("auto", 200, PrefillPath.MULTIPLEXED, "pd"),
        ("auto", 257, PrefillPath.DEDICATED, "p"),
        ("dedicated", 10, PrefillPath.DEDICATED, "p"),
        ("multiplexed", 5000, PrefillPath.MULTIPLEXED, "pd"),
    ],
)
def test_multiplexing_short_prompts_on_the_decoder(mode, tokens, path, prefill):
    workers = [worker("e", {E}), worker("p", {P}), worker("pd", {P, D})]
    plan = route(workers, ask(tokens), RoutingConfig(prefill_mode=mode, multiplex_max_tokens=256))
    assert (plan.path, plan.prefill.worker_id) == (path, prefill)
    assert plan.decoder.worker_id == "pd"


def test_stale_workers_are_skipped_and_missing_roles_give_none():
    workers = [worker("epd-old", {E, P, D}, age=10.0), worker("epd", {E, P, D}, age=0.5)]
    assert route(workers, ask(), RoutingConfig(max_heartbeat_age_s=3)).decoder.worker_id == "epd"
    assert route([worker("epd", {E, P, D}, age=10.0)], ask(), RoutingConfig()) is None
    assert route([worker("p", {P}), worker("d", {D})], ask(images=1), RoutingConfig()) is None
    assert route([worker("p", {P}), worker("d", {D})], ask(images=0), RoutingConfig()) is not None
    assert route([worker("e", {E}), worker("d", {D})], ask(), RoutingConfig()) is None


def test_routing_config_rejects_unknown_modes():
    with pytest.raises(ValueError, match="prefill_mode"):
        RoutingConfig(prefill_mode="sometimes")


def test_topology_strings():
    groups = parse_topology("E2+P2+D4")
    assert [(g.label, g.count) for g in groups] == [("E", 2), ("P", 2), ("D", 4)]
    assert [(g.label, g.count) for g in parse_topology("ep1+D2")] == [("EP", 1), ("D", 2)]
    assert [g.label for g in parse_topology("DPE1")] == ["EPD"]
    for bad, fragment in [
        ("E1+P1", "no worker for ['decode']"),
        ("X1", "bad topology"),
        ("EE1+P1+D1", "repeated"),
        ("EPD0", "at least one"),
        ("EPD", "bad topology"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            parse_topology(bad)


def test_decoders_join_where_dedicated_prefill_workers_hand_requests_to_decoders_that_prefill():
    joins = {
        t: decoders_join(parse_topology(t)) for t in ("E1+P1+PD1", "EP4+PD4", "EP4+D4", "EPD8", "E2+P2+D4", "ED1+P1")
    }
    assert joins == {
        "E1+P1+PD1": True,
        "EP4+PD4": True,
        "EP4+D4": False,
        "EPD8": False,
        "E2+P2+D4": False,
        "ED1+P1": False,
    }


def test_policy_modules_import_no_torch():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, common.policy.routing, common.topology, common.workers; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"


def test_excluded_workers_are_routed_around():
    workers = [worker("e", {E}), worker("p1", {P}), worker("p2", {P}, num_waiting=9), worker("d", {D})]
    assert route(workers, ask(), RoutingConfig()).prefill.worker_id == "p1"
    retry = RouteSummary("r", 100, 1, 16, exclude=frozenset({"p1"}))
    assert route(workers, retry, RoutingConfig()).prefill.worker_id == "p2"
    assert route(workers, RouteSummary("r", 100, 1, 16, exclude=frozenset({"d"})), RoutingConfig()) is None
