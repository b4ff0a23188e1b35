from bench.prefix_cache import CONFIGS, QUESTIONS, image_uri, summarize
from epdmesh.cli import build_parser


def test_each_configuration_is_a_serve_command_line_and_they_differ_where_they_should():
    parsed = {name: build_parser().parse_args(["serve", *extra]) for name, extra in CONFIGS.items()}
    assert [(a.enable_prefix_caching, a.cache_aware_routing) for a in parsed.values()] == [
        (False, True),
        (True, False),
        (True, True),
    ]


def test_first_and_later_turns_are_summarized_apart_and_cached_tokens_count_only_later_ones():
    rows = [
        {"turn": 0, "ttft_ms": 100.0, "prompt_tokens": 600, "cached_tokens": 0},
        {"turn": 1, "ttft_ms": 20.0, "prompt_tokens": 640, "cached_tokens": 576},
        {"turn": 1, "ttft_ms": 60.0, "prompt_tokens": 640, "cached_tokens": 0},
        {"turn": 2, "ttft_ms": 30.0, "prompt_tokens": 720, "cached_tokens": 624},
    ]
    s = summarize(rows)
    assert s["first_turn_p50_ttft_ms"] == 100.0 and s["later_turns_p50_ttft_ms"] == 30.0
    assert s["later_turns_p90_ttft_ms"] == 60.0 and s["num_requests"] == 4
    assert s["later_turns_cached_fraction"] == (576 + 624) / (640 + 640 + 720)


def test_every_chat_has_its_own_image():
    assert image_uri(1) != image_uri(2) == image_uri(2) and len(set(QUESTIONS)) == len(QUESTIONS)
