"""`epdmesh serve` as real processes (one engine; an E1+P1+D1 mesh), driven over HTTP with the openai client."""

import asyncio
import base64
import concurrent.futures
import io
import json
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.services.servers import MODEL, assert_pools_full
from tests.support import image, text_of

TRACE = Path(tempfile.mkdtemp(prefix="epdmesh-test-")) / "trace.jsonl"
SERVER_ARGS = ("--record-trace", str(TRACE))  # every request of this module recorded, local and mesh


def data_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def to_openai(conversation):
    messages = []
    for m in conversation:
        parts = [
            {"type": "text", "text": p["text"]}
            if p["type"] == "text"
            else {"type": "image_url", "image_url": {"url": data_uri(p["image"])}}
            for p in m["content"]
        ]
        messages.append({"role": m["role"], "content": parts})
    return messages


def test_models_and_health(server):
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    models = openai.OpenAI(base_url=f"{server}/v1", api_key="none").models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_concurrent_chat_requests_give_the_transformers_tokens(server, chat_reference, processors):
    cases, refs = chat_reference
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none")

    async def ask(case):
        return await client.chat.completions.create(
            model=MODEL,
            messages=to_openai(case.conversation),
            max_tokens=case.max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )

    async def main():
        return await asyncio.gather(*(ask(c) for c in cases))

    responses = asyncio.run(main())
    assert len(cases) >= 8
    for case, resp in zip(cases, responses):
        ref = refs[case.name]
        choice = resp.choices[0]
        assert choice.model_extra["token_ids"] == ref.tokens, case.name
        assert choice.message.content == processors["tiny"].detokenize(ref.tokens)
        assert choice.finish_reason == ("stop" if ref.tokens[-1] == 2 else "length")
        assert resp.usage.prompt_tokens == len(ref.prompt_ids)
        assert resp.usage.completion_tokens == len(ref.tokens)
    assert_pools_full(server)


def test_a_left_out_max_tokens_generates_to_the_end_of_the_context(server):
    """As vLLM: no max_tokens means the rest of the model's context (4,096 tokens here), not a fixed few tokens."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = [{"role": "user", "content": text_of(3200, 11)}]  # ~3,970 tokens: the rest is ~120
    default = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"return_token_ids": True}
    )
    total = default.usage.prompt_tokens + default.usage.completion_tokens
    assert default.usage.completion_tokens > 16
    assert (total == 4096) == (default.choices[0].finish_reason == "length")
    explicit = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=4096 - default.usage.prompt_tokens,
        extra_body={"return_token_ids": True},
    )
    assert explicit.choices[0].model_extra["token_ids"] == default.choices[0].model_extra["token_ids"]
    assert_pools_full(server)


def test_streaming_matches_the_whole_answer_and_reports_usage(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(image(3, 120, 90))}},
                {"type": "text", "text": "What is here?"},
            ],
        }
    ]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_stats_count_every_chunk_to_that_chunk_as_vllm_does(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = [{"role": "user", "content": "Count to ten"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            n=2,
            seed=5,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    assert all(c.usage.prompt_tokens == prompt for c in chunks)
    assert chunks[0].usage.completion_tokens == 0  # the role chunk, before any token was counted
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        for choice in c.choices:
            seen[choice.index] += len(getattr(choice, "token_ids", None) or [])
        assert c.usage.completion_tokens == sum(seen.values())  # every token sent so far, both choices
        assert c.usage.total_tokens == prompt + c.usage.completion_tokens
    assert seen == {0: 12, 1: 12} and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    plain = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_n_choices_are_requests_seeded_s_plus_i_streamed_interleaved_and_counted_once_for_the_prompt(server):
    """n > 1 as vLLM serves it: choice i of a request with seed s is the answer of that request with seed s + i;
    streamed, every choice's chunks carry its index and join to the whole answer's text; usage counts the prompt
    once and every choice's tokens."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(image(4, 100, 80))}},
                {"type": "text", "text": "Describe it"},
            ],
        }
    ]
    ask = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.2, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(n=3, seed=41, **ask)
    singles = [client.chat.completions.create(seed=41 + i, **ask).choices[0] for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in whole.choices] == [c.model_extra["token_ids"] for c in singles]
    assert len({tuple(c.model_extra["token_ids"]) for c in whole.choices}) > 1  # sampled: the choices differ
    assert whole.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in whole.choices)
    assert whole.usage.prompt_tokens == client.chat.completions.create(seed=41, **ask).usage.prompt_tokens
    chunks = list(
        client.chat.completions.create(n=3, seed=41, stream=True, stream_options={"include_usage": True}, **ask)
    )
    texts, finished = ["", "", ""], [None] * 3
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == [c.message.content for c in whole.choices] and finished == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    greedy = client.chat.completions.create(n=2, **{**ask, "temperature": 0})
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert_pools_full(server)


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_client_gone_before_its_first_token_ends_its_requests_there(server):
    """Starlette notices a client that left only when it writes to it: a prefill queued or running for a client
    gone ran to its end (and a burst of those held up everyone after). Now the requests end when it leaves: no
    prefill completes for them on any worker, nothing is counted as answered, and the request gauge goes back."""
    import socket

    def scrape() -> tuple[float, float]:
        gateway = httpx.get(f"{server}/metrics").text
        workers = [w for w in httpx.get(f"{server}/stats").json().get("workers", {}).values() if w.get("metrics_port")]
        prefills = sum(
            _counter(
                httpx.get(f"http://127.0.0.1:{w['metrics_port']}/metrics").text, "epdmesh:prefill_time_seconds_count"
            )
            for w in workers
        )
        return _counter(gateway, "epdmesh:request_success_total"), prefills

    before = scrape()
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Long story " * 400}],
            "n": 3,
            "max_tokens": 50,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        time.sleep(0.3)  # routed and prefilling (three 1,200-token prompts take seconds here)
    assert_pools_full(server)
    deadline = time.monotonic() + 30
    while _counter(httpx.get(f"{server}/metrics").text, "epdmesh:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the request gauge did not go back to 0"
        time.sleep(0.1)
    assert scrape() == before


def test_stop_strings_cut_the_text(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = [{"role": "user", "content": "Describe the picture please"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0).choices[0]
    stop = full.message.content[6:8]
    cut = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert (
        cut.finish_reason == "stop" and cut.message.content == full.message.content[: full.message.content.index(stop)]
    )
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.message.content


def test_client_disconnect_mid_stream_frees_pages_and_others_finish(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")

    def ask_other() -> str:
        return (
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=30, temperature=0
            )
            .choices[0]
            .message.content
        )

    expected = ask_other()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell a long story"}],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        others = [pool.submit(ask_other) for _ in range(2)]  # in flight while the first client walks away
        received = []
        for chunk in stream:
            received.append(chunk)
            if len(received) == 6:
                break
        stream.close()
        assert [f.result(timeout=60) for f in others] == [expected, expected]
    assert len(received) == 6 and received[0].choices[0].delta.role == "assistant"
    assert_pools_full(server)


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        (
            json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "does not exist",
        ),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "non-empty list"),
        (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}).encode(), 400, "role"),
        (
            json.dumps({"model": MODEL, "n": 17, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            400,
            "between 1 and 16",
        ),
        (
            json.dumps({"model": MODEL, "temperature": -1, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps(
                {"model": MODEL, "max_tokens": "many", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": MODEL, "seed": 2**70, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            400,
            "64-bit",
        ),
        (
            json.dumps(
                {"model": MODEL, "stop_token_ids": [999999], "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            400,
            "outside the vocabulary",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": [  # 149 bytes that would resize to gigabytes
                                {"type": "image_url", "image_url": {"url": data_uri(Image.new("RGB", (1, 16000)))}}
                            ],
                        }
                    ],
                }
            ).encode(),
            400,
            "200:1",
        ),
        (
            json.dumps(
                {"model": MODEL, "slo": {"ttft_ms": -5}, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            400,
            "slo.ttft_ms",
        ),
        (
            json.dumps(
                {"model": MODEL, "response_format": {"type": "xml"}, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            400,
            "json_object or json_schema",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                    },
                    "messages": [{"role": "user", "content": "hi"}],
                }
            ).encode(),
            400,
            "cannot be followed",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "response_format": {"type": "json_object"},
                    "guided_regex": "a+",
                    "messages": [{"role": "user", "content": "hi"}],
                }
            ).encode(),
            400,
            "one structured-output constraint",
        ),
        (
            json.dumps({"model": MODEL, "guided_choice": [], "messages": [{"role": "user", "content": "hi"}]}).encode(),
            400,
            "non-empty list",
        ),
        (
            json.dumps(
                {"model": MODEL, "guided_regex": "[^\\s\\S]", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            400,
            "no output satisfies",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}
                            ],
                        }
                    ],
                }
            ).encode(),
            400,
            "not an image this server can read",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
                        }
                    ],
                }
            ).encode(),
            400,
            "base64",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": [  # over 64 KiB: parsed off the event loop
                                {
                                    "type": "image_url",
                                    "image_url": {
                                        "url": "data:image/png;base64,"
                                        + base64.b64encode(b"\x89PNG" + bytes(100_000)).decode()
                                    },
                                }
                            ],
                        }
                    ],
                }
            ).encode(),
            400,
            "not an image this server can read",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                        }
                    ],
                }
            ).encode(),
            400,
            "remote image URLs are disabled",
        ),
        (
            json.dumps(
                {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "word " * 5000}]}
            ).encode(),
            400,
            "over the model's limit",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "max_tokens": 10,
                    "messages": [
                        {
                            "role": "user",
                            "content": [  # the mesh checks before routing
                                {"type": "image_url", "image_url": {"url": data_uri(image(3, 64, 64))}},
                                {"type": "text", "text": "word " * 5000},
                            ],
                        }
                    ],
                }
            ).encode(),
            400,
            "over the model's limit",
        ),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, body, status, fragment):
    resp = httpx.post(
        f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and error["code"] == status
    ok = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert ok.status_code == 200
    assert_pools_full(server)


@pytest.fixture(scope="module")
def raw_reference(tiny_dir, processors):
    """transformers' greedy answer (and logits) to a prompt given as token ids, no chat template."""
    import torch

    from tests.support import hf_reference, mixed_cases

    case = next(c for c in mixed_cases() if c.conversation is None)
    return case, hf_reference(tiny_dir, processors["tiny"], [case], torch.float32)[case.name]


def test_text_completions_continue_the_prompt_as_it_is_with_the_transformers_tokens(server, raw_reference, processors):
    """`/v1/completions` (vLLM serves it for multimodal models too): the prompt as token ids or as text, no chat
    template; greedy tokens and legacy-form logprobs are transformers'; the stream joins to the same text."""
    import torch

    case, ref = raw_reference
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    resp = client.completions.create(
        model=MODEL,
        prompt=case.raw_ids,
        max_tokens=case.max_tokens,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert choice.model_extra["token_ids"] == ref.tokens and resp.usage.prompt_tokens == len(case.raw_ids)
    assert choice.text == processors["tiny"].detokenize(ref.tokens)
    for step, (token, value, top) in enumerate(
        zip(ref.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)
    ):
        assert abs(value - torch.log_softmax(ref.logits[step], -1)[token].item()) <= 1e-3
        assert 1 <= len(top) <= 3 and top[choice.logprobs.tokens[step]] == value  # the top 2 and the sampled token
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    text = "the man holding a red cup"
    ids = processors["tiny"].tokenizer(text)["input_ids"]
    by_text = client.completions.create(
        model=MODEL, prompt=text, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    by_ids = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    assert by_text.choices[0].model_extra["token_ids"] == by_ids.choices[0].model_extra["token_ids"]
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 10
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=text, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "text_completion" for c in chunks) and chunks[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_text.choices[0].text
    assert client.completions.create(model=MODEL, prompt=text, temperature=0).usage.completion_tokens <= 16
    for body, fragment in [
        ({"prompt": ["one", "two"]}, "holds 2 prompts"),
        ({"prompt": "x", "echo": True}, "'echo'"),
        ({"prompt": "x", "logprobs": True}, "integer from 0 to 20"),
        ({"prompt": ""}, "'prompt'"),
        ({"prompt": "x", "suffix": "y"}, "'suffix'"),
        ({}, "'prompt'"),
        ({"prompt": "a picture <image> here"}, "image placeholder"),
    ]:
        bad = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body})
        assert bad.status_code == 400 and fragment in bad.json()["error"]["message"], (body, bad.text)
    assert_pools_full(server)


def test_a_model_is_retrieved_by_name_and_an_unknown_one_is_a_404(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "epdmesh"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_tokenize_gives_the_ids_transformers_gives_for_a_prompt_and_for_a_chat_and_detokenize_reverses(
    server, processors
):
    hf = processors["tiny"].processor  # the checkpoint's own transformers processor
    prompt = "The quick brown fox jumps over the lazy dog"
    got = httpx.post(f"{server}/tokenize", json={"prompt": prompt, "return_token_strs": True}, timeout=60).json()
    want = hf.tokenizer(prompt)["input_ids"]
    models = httpx.get(f"{server}/v1/models", timeout=60).json()["data"][0]
    assert got == {
        "count": len(want),
        "max_model_len": models["max_model_len"],
        "tokens": want,
        "token_strs": hf.tokenizer.convert_ids_to_tokens(want),
    }
    bare = httpx.post(
        f"{server}/tokenize", json={"model": MODEL, "prompt": prompt, "add_special_tokens": False}, timeout=60
    ).json()
    assert bare["tokens"] == hf.tokenizer(prompt, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    assert httpx.post(f"{server}/detokenize", json={"tokens": bare["tokens"]}, timeout=60).json() == {"prompt": prompt}

    img = image(5, 80, 60)
    chat = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is it?"}]}]
    counts = {}
    for generation_prompt in (True, False):
        body = {"messages": to_openai(chat), "add_generation_prompt": generation_prompt}
        got = httpx.post(f"{server}/tokenize", json=body, timeout=60).json()
        want = hf.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        want = want[0] if isinstance(want[0], list) else want
        assert got["tokens"] == list(want) and got["count"] == len(want)
        counts[generation_prompt] = got["count"]
    answer = openai.OpenAI(base_url=f"{server}/v1", api_key="none").chat.completions.create(
        model=MODEL, messages=to_openai(chat), max_tokens=1, temperature=0
    )
    assert answer.usage.prompt_tokens == counts[True] > counts[False]  # what the chat endpoint counts as its prompt


def test_a_body_nested_too_deep_is_a_400_on_every_endpoint(server):
    deep = b'{"model": "%s", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "x": ' % MODEL.encode()
    deep += b"[" * 5000 + b"]" * 5000 + b"}"
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        resp = httpx.post(f"{server}{path}", content=deep, headers={"content-type": "application/json"}, timeout=60)
        assert resp.status_code == 400 and "nests too deeply" in resp.json()["error"]["message"], (path, resp.text)


@pytest.mark.parametrize(
    "path,body,status,fragment",
    [
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "either 'prompt'"),
        ("/tokenize", {}, 400, "either 'prompt'"),
        ("/tokenize", {"prompt": 5}, 400, "'prompt' must be a string"),
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ("/tokenize", {"messages": []}, 400, "non-empty list"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "true or false"),
        ("/tokenize", {"prompt": "word " * 2_000_000}, 400, "characters of text"),
        ("/detokenize", {"tokens": [1, "two"]}, 400, "list of token ids"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "token id 1000000 is not in the vocabulary"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input_with_a_clear_4xx(server, path, body, status, fragment):
    resp = httpx.post(f"{server}{path}", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    assert fragment in resp.json()["error"]["message"]


def test_an_unknown_endpoint_or_method_is_an_openai_error_that_names_what_is_served(server):
    missing = httpx.post(f"{server}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (
        error["code"] == 404
        and "POST /v1/embeddings" in error["message"]
        and "/v1/chat/completions" in error["message"]
    )
    wrong = httpx.get(f"{server}/v1/chat/completions", timeout=60)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert "takes POST, not GET" in wrong.json()["error"]["message"]


def _new_lines(seen: int, want: int, timeout: float = 20.0) -> list[dict]:
    """The trace's lines after its first `seen`, once there are `want` of them (a line is written as a request's
    stream ends)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = TRACE.read_text().splitlines()[seen:] if TRACE.exists() else []
        if len(lines) >= want or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)


def test_the_recorded_trace_has_every_request_as_served_and_replays_to_the_same_prompts(server):
    from bench import conversation, recorded
    from common import trace

    seen = len(TRACE.read_text().splitlines()) if TRACE.exists() else 0
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    words = text_of(40, 3)
    chat = lambda img: [  # noqa: E731
        {"role": "user", "content": [{"type": "text", "text": words}, {"type": "image", "image": img}]}
    ]
    conversations = [chat(image(1, 64, 48)), chat(image(1, 64, 48)), chat(image(2, 64, 48))]
    conversations.append([{"role": "user", "content": [{"type": "text", "text": words}]}])
    answers = [
        client.chat.completions.create(model=MODEL, messages=to_openai(c), max_tokens=3 + i, temperature=0)
        for i, c in enumerate(conversations)
    ]
    lines = _new_lines(seen, 4)
    assert len(lines) == 4
    rows = [trace.row_of(line) for line in lines]
    for row, answer, i in zip(rows, answers, range(4)):
        assert (row.input_length, row.output_length) == (answer.usage.prompt_tokens, answer.usage.completion_tokens)
        assert row.max_tokens == 3 + i and row.finish_reason == answer.choices[0].finish_reason and row.ttft_ms > 0
        assert row.block_tokens == 16 and len(row.hash_ids) == -(-row.input_length // 16)
    ids = httpx.post(f"{server}/tokenize", json={"messages": to_openai(conversations[0])}, timeout=60).json()["tokens"]
    image_token = max(set(ids), key=ids.count)  # the placeholders outnumber every word here
    (picture,) = rows[0].images
    assert picture.at == ids.index(image_token) > 0 and picture.tokens == ids.count(image_token)
    assert rows[0].hash_ids == rows[1].hash_ids and rows[0].images == rows[1].images  # the same chat twice
    assert rows[2].images[0].id != picture.id and rows[2].hash_ids != rows[0].hash_ids  # another picture
    assert rows[3].images == () and rows[3].hash_ids != rows[0].hash_ids
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)

    vocab = conversation.calibrate(server)  # replayed on the server that recorded them: the same prompt lengths
    planned = recorded.plan(rows, vocab, recorded.Overheads(vocab.count, vocab))
    bodies = recorded.request_bodies(planned, vocab, MODEL)
    for row, body in zip(rows, bodies):
        body = {**body, "stream": False, "max_tokens": 1}
        body.pop("stream_options")
        got = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120).json()
        assert got["usage"]["prompt_tokens"] == row.input_length
    assert len(_new_lines(seen, 8)) == 8  # the replayed ones are recorded too
    metrics = httpx.get(f"{server}/metrics").text  # this server's lines (the file has the other server's too)
    assert _counter(metrics, 'epdmesh:trace_lines_total{model_name="tiny",outcome="recorded"}') >= 8
    assert _counter(metrics, 'epdmesh:trace_lines_total{model_name="tiny",outcome="lost"}') == 0


def test_a_request_whose_client_leaves_mid_answer_is_recorded_as_aborted_and_a_streamed_answer_as_finished(server):
    seen = len(TRACE.read_text().splitlines()) if TRACE.exists() else 0
    streamed = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**streamed, "ignore_eos": True}) as response:
        assert sum(1 for line in response.iter_lines() if line.startswith("data: ")) > 1
    (line,) = _new_lines(seen, 1)
    assert (line["finish_reason"], line["output_length"]) == ("length", 6)
    seen += 1
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # a token came: leave
    (line,) = _new_lines(seen, 1)
    assert line["finish_reason"] == "abort" and 0 < line["output_length"] < 400 and line["max_tokens"] == 400
    assert_pools_full(server)
