"""Byte-identical outputs across topologies: the same concurrent greedy chats through the HTTP API
(official openai client) give exactly transformers' tokens on every mesh shape, with real processes,
real gRPC, real Redis and real page bytes; afterwards every worker's pools are full again."""

import asyncio
import collections

import httpx
import openai
import pytest

from tests.services.servers import MODEL, assert_pools_full, running_server
from tests.services.test_gateway import to_openai

TOPOLOGIES = {
    "EPD1": ("EPD1", ()),  # colocated: one worker, no pages move
    "EP1+D1": ("EP1+D1", ()),  # encode+prefill together, KV pages move to the decoder
    "ED1+P1": ("ED1+P1", ()),  # image pages move to the prefill worker, KV pages back to the encoder's process
    # decoders that prefill too: short prompts prefill on the decoder (no KV moves), long ones on P
    "multiplexed": ("E1+P1+PD1", ("--prefill-mode", "auto", "--multiplex-max-tokens", "300")),
}


async def _ask_all(base, cases):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    try:
        return await asyncio.gather(*(
            client.chat.completions.create(model=MODEL, messages=to_openai(c.conversation), max_tokens=c.max_tokens,
                                           temperature=0, extra_body={"return_token_ids": True})
            for c in cases))
    finally:
        await client.close()


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_topology_gives_the_transformers_tokens(name, tiny_dir, chat_reference, tmp_path):
    topology, extra = TOPOLOGIES[name]
    cases, refs = chat_reference
    assert len(cases) >= 8 and any(c.conversation for c in cases)
    with running_server(tiny_dir, topology, tmp_path / "serve.log", *extra) as base:
        responses = asyncio.run(_ask_all(base, cases))
        for case, resp in zip(cases, responses):
            assert resp.choices[0].model_extra["token_ids"] == refs[case.name].tokens, (name, case.name)
            assert resp.usage.prompt_tokens == len(refs[case.name].prompt_ids)
        paths = collections.Counter({k: v for k, v in httpx.get(f"{base}/stats").json()["paths"].items() if v})
        expected = {"EPD1": {"colocated"}, "EP1+D1": {"dedicated"}, "ED1+P1": {"dedicated"},
                    "multiplexed": {"multiplexed", "dedicated"}}[name]
        assert set(paths) == expected, paths
        assert sum(paths.values()) == len(cases)
        assert_pools_full(base)
