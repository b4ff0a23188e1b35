"""Prefix caching through the HTTP API, as `epdmesh serve` runs by default: a chat sent again is answered from its
cached prefix — transformers' tokens still, the cached tokens in OpenAI's `usage.prompt_tokens_details`, and where
the cache holds an image's KV the image is neither encoded nor pulled again (cache-aware routing sends it back to
the worker that holds it, and sends no Encode)."""

import asyncio

import httpx
import openai
import pytest

from tests.services.servers import MODEL, assert_pools_full, running_server
from tests.services.test_gateway import to_openai
from tests.services.test_telemetry import scrape, total

CASES = ("img-long", "img-tall", "text-200")  # two images with a block or more of text after them, and a text
COVERED = ("img-long", "img-tall")  # their cached prefix holds every image placeholder's KV


async def _ask(base, case):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    try:
        return await client.chat.completions.create(
            model=MODEL,
            messages=to_openai(case.conversation),
            max_tokens=case.max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    finally:
        await client.close()


def _worker_metrics(base) -> dict[str, dict[str, float]]:
    workers = httpx.get(f"{base}/stats", timeout=10).json().get("workers", {}).values()
    return {w["roles"]: scrape(f"http://127.0.0.1:{w['metrics_port']}/metrics") for w in workers}


@pytest.mark.parametrize("topology,prefills", [("local", None), ("E1+P1+D1", "P"), ("E1+PD1", "PD")])
def test_a_chat_sent_again_is_answered_from_its_cached_prefix(topology, prefills, tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    cases = [next(c for c in cases if c.name == name) for name in CASES]
    with running_server(tiny_dir, topology, tmp_path / "serve.log") as base:
        before = _worker_metrics(base) if prefills else {}
        for round_ in (1, 2):
            for case in cases:  # one at a time: each finds what the ones before committed
                resp = asyncio.run(_ask(base, case))
                ref = refs[case.name]
                assert resp.choices[0].model_extra["token_ids"] == ref.tokens, (topology, round_, case.name)
                cached = resp.usage.prompt_tokens_details.cached_tokens
                # every full block but the one holding the last prompt token, the second time
                assert cached == (0 if round_ == 1 else (len(ref.prompt_ids) - 1) // 16 * 16), (
                    topology,
                    round_,
                    case.name,
                )
        assert_pools_full(base)
        if not prefills:
            return
        after = _worker_metrics(base)

        def delta(role, name, **labels):
            return total(after[role], name, **labels) - total(before[role], name, **labels)

        hits = sum((len(refs[c.name].prompt_ids) - 1) // 16 * 16 for c in cases)
        assert delta(prefills, "epdmesh:prefix_cache_hits_total") == hits
        assert delta(prefills, "epdmesh:prefix_cache_queries_total") == 2 * sum(
            len(refs[c.name].prompt_ids) for c in cases
        )
        assert delta(prefills, "epdmesh:image_encodes_skipped_total") == len(COVERED)
        image_bytes = 256 * 256 * 4  # one image's pages: 256 tokens × hidden 256 × fp32
        assert (
            delta(prefills, "epdmesh:transfer_bytes_total", kind="image") == len(COVERED) * image_bytes
        )  # round 1 only
        # the second time the router predicted the images' KV cached there: no Encode was sent at all
        assert delta("E", "epdmesh:encode_time_seconds_count") == len(COVERED)


@pytest.mark.parametrize("topology", ["local", "E1+P1+D1"])
def test_a_cache_salt_shares_cached_blocks_only_among_requests_that_carry_it(
    topology, tiny_dir, chat_reference, tmp_path
):
    """vLLM's `cache_salt`: a tenant's requests share prefix-cache blocks with each other and with nobody else (another
    tenant cannot learn from a quicker first token that a prompt was seen). The answers stay transformers' tokens."""
    cases, refs = chat_reference
    case = next(c for c in cases if c.name == "img-long")
    ref = refs[case.name]
    full = (len(ref.prompt_ids) - 1) // 16 * 16  # every block but the one holding the last prompt token
    with running_server(tiny_dir, topology, tmp_path / "serve.log") as base:
        client = httpx.Client(base_url=base, timeout=120)
        body = {
            "model": MODEL,
            "messages": to_openai(case.conversation),
            "max_tokens": case.max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        seen = []
        for salt in ("tenant-a", "tenant-a", "tenant-b", None, None, "tenant-b"):
            resp = client.post("/v1/chat/completions", json={**body, **({"cache_salt": salt} if salt else {})}).json()
            assert resp["choices"][0]["token_ids"] == ref.tokens, (topology, salt)
            seen.append(resp["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert seen == [0, full, 0, 0, full, full], (topology, seen)
        for bad in ("", 7, ["x"]):
            resp = client.post("/v1/chat/completions", json={**body, "cache_salt": bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
        assert_pools_full(base)
