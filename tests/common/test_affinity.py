"""Prefix-cache affinity: the router's index of what it sent where, and how both policies use its predictions."""

import dataclasses

import pytest

from common.latency import LatencyProfile, StageCost
from common.policy.affinity import PrefixIndex, prompt_hashes
from common.policy.multiplex import MultiplexConfig, route_slo
from common.policy.routing import PrefillPath, RouteSummary, RoutingConfig, route
from common.request import Stage
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot

E, P, D = Stage.ENCODE, Stage.PREFILL, Stage.DECODE
PROFILE = LatencyProfile(
    "t",
    "analytic",
    "hw",
    "m",
    encode=StageCost(per_unit_ms=10.0),
    prefill=StageCost(per_unit_ms=0.1),
    decode=StageCost(overhead_ms=5.0, per_unit_ms=1.0),
    transfer_latency_ms=0.0,
    transfer_gbps=1.0,
    image_tokens=576,
)


def w(wid, roles, **load):
    return WorkerSnapshot(WorkerInfo(wid, "127.0.0.1:1", frozenset(roles)), WorkerLoad(**load), 0.0)


def ask(tokens=400, images=0, cached=(), image_end=0):
    return RouteSummary("r", tokens, images, 16, cached_tokens=tuple(cached), image_end=image_end)


def test_prompt_hashes_chain_full_blocks_and_are_salted_by_the_images():
    ids = list(range(100, 150))  # 3 full blocks of 16, 2 tokens over
    plain, img_a, img_b = prompt_hashes(ids, []), prompt_hashes(ids, [("a", 4)]), prompt_hashes(ids, [("b", 4)])
    assert len(plain) == 3 and len({plain, img_a, img_b}) == 3
    assert prompt_hashes(ids, [("a", 4)]) == img_a  # a pure function of tokens and image identities
    longer = prompt_hashes(ids + list(range(200, 230)), [("a", 4)])
    assert longer[:3] == img_a and len(longer) == 5  # a longer prompt extends the same chain
    assert prompt_hashes(ids[:5] + [9] + ids[6:], [])[0] != plain[0]  # one token changed: a different prefix


def test_an_image_enters_the_hashes_where_it_begins_so_the_text_before_it_is_shared():
    from common.request import image_marks

    ids = list(range(100, 140)) + [7] * 8 + list(range(200, 230))  # an image of 8 placeholders at 40; 78 tokens
    a, b = prompt_hashes(ids, [("a", 8)], image_token_id=7), prompt_hashes(ids, [("b", 8)], image_token_id=7)
    assert len(a) == 4 and a[:2] == b[:2] == prompt_hashes(ids, [])[:2]  # blocks 0-1 end before position 40
    assert all(x != y for x, y in zip(a[2:], b[2:]))  # block 2 holds the image's start: from there on, its own
    two = ids[:60] + [7] * 4 + ids[60:]  # a second image of 4 at 60
    marks = image_marks(two, 7, [("a", 8), ("c", 4)])
    assert [m[0] for m in marks] == [40, 60] and marks[0] == image_marks(ids, 7, [("a", 8)])[0]
    # placeholders that do not add up to the images (or no placeholder id): every image marked at 0, nothing shared
    assert [m[0] for m in image_marks(ids, 7, [("a", 8), ("c", 4)])] == [0, 0]
    assert prompt_hashes(ids, [("a", 8)])[0] != prompt_hashes(ids, [])[0]


def test_the_index_matches_leading_blocks_and_forgets_least_recent_ones_beyond_a_workers_cache():
    index = PrefixIndex(block_tokens=16)
    first, second = prompt_hashes(list(range(64)), []), prompt_hashes(list(range(1000, 1064)), [])
    index.record("p1", first, capacity_tokens=6 * 16)
    assert index.matched_tokens("p1", first) == 64 and index.matched_tokens("p2", first) == 0
    assert index.matched_tokens("p1", first[:2] + second[2:]) == 32  # only the leading run counts
    index.record("p1", second, capacity_tokens=6 * 16)  # 8 blocks into room for 6: first's two oldest go
    assert index.matched_tokens("p1", second) == 64 and index.matched_tokens("p1", first) == 0
    assert len(index) == 6
    index.keep_only({"p2"})
    assert index.matched_tokens("p1", second) == 0 and len(index) == 0


def test_least_loaded_prefers_the_worker_holding_the_prompt_within_the_imbalance():
    mesh = [w("p1", {P}, num_waiting=2), w("p2", {P}), w("d", {D})]
    assert route(mesh, ask(), RoutingConfig()).prefill.worker_id == "p2"  # no prediction: least queued
    cached = ask(cached=[("p1", 320)])
    assert route(mesh, cached, RoutingConfig()).prefill.worker_id == "p1"
    assert route(mesh, cached, RoutingConfig(affinity_max_imbalance=1)).prefill.worker_id == "p2"  # too busy
    both = ask(cached=[("p1", 320), ("p2", 320)])
    assert route(mesh, both, RoutingConfig()).prefill.worker_id == "p2"  # equal hits: the less loaded


def test_a_colocated_mesh_sends_a_prompt_back_to_the_worker_holding_it():
    mesh = [w("epd1", {E, P, D}, unfinished_decode_tokens=100, num_running=1), w("epd2", {E, P, D})]
    assert route(mesh, ask(images=1), RoutingConfig()).prefill.worker_id == "epd2"
    plan = route(mesh, ask(images=1, cached=[("epd1", 592)], image_end=581), RoutingConfig())
    assert (plan.encoder.worker_id, plan.prefill.worker_id, plan.decoder.worker_id, plan.path) == (
        "epd1",
        "epd1",
        "epd1",
        PrefillPath.COLOCATED,
    )


def test_the_slo_policy_prices_a_predicted_hit_as_the_rest_of_the_prompt_and_no_encode_wait():
    mesh = [w("e", {E}, queued_images=2), w("p1", {P}, queued_prefill_tokens=1000), w("p2", {P}), w("d", {D})]
    cold = route_slo(mesh, ask(tokens=1200, images=1, image_end=600), 2000, 100, 0, PROFILE, MultiplexConfig())
    assert cold.plan.prefill.worker_id == "p2"
    # p2: encode wait (3 images × 10 ms) + 1200 × 0.1 ms = 150 ms
    assert cold.predicted_ttft_ms == pytest.approx(30 + 120)
    hit = ask(tokens=1200, images=1, image_end=600, cached=[("p1", 1184)])
    warm = route_slo(mesh, hit, 2000, 100, 0, PROFILE, MultiplexConfig())
    # p1: its queue (1000 × 0.1 ms) + the 16 tokens it lacks, and no wait for the image: 101.6 ms
    assert warm.plan.prefill.worker_id == "p1" and warm.predicted_ttft_ms == pytest.approx(100 + 1.6)
    partial = dataclasses.replace(hit, cached_tokens=(("p1", 400),))  # the images not all cached: the encode counts
    assert route_slo(mesh, partial, 2000, 100, 0, PROFILE, MultiplexConfig()).plan.prefill.worker_id == "p2"


def test_the_slo_policy_counts_a_hit_on_a_decoder_that_prefills_from_the_cached_prefix():
    mesh = [w("p", {P}, queued_prefill_tokens=3000), w("pd", {P, D}, running_decode_batch=4)]
    # the 2000-token prefill alone (200 ms) breaks a 100 ms TBT on the decoder; the 16 tokens it lacks do not
    miss = route_slo(mesh, ask(tokens=2000), 2000, 100, 0, PROFILE, MultiplexConfig())
    hit = route_slo(mesh, ask(tokens=2000, cached=[("pd", 1984)]), 2000, 100, 0, PROFILE, MultiplexConfig())
    assert miss.plan.path == PrefillPath.DEDICATED and hit.plan.path == PrefillPath.MULTIPLEXED
    assert hit.plan.prefill.worker_id == "pd" and hit.meets_slo
