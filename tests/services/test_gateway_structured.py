"""Structured output and tool calling through `epdmesh serve` (one engine; an E1+P1+D1 mesh) with the openai client:
the answer holds to its constraint, and is the tokens one in-process engine samples under the same grammar."""

import json

import httpx
import openai
import pytest

from tests.services.servers import MODEL, assert_pools_full

KEY = "sk-epdmesh-test"
SERVER_ARGS = ("--api-key", KEY)  # these servers also check the API-key wiring of `serve`, local and mesh
AUTH = {"Authorization": f"Bearer {KEY}"}

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def structured_reference(tiny_dir, processors):
    """One in-process engine's greedy answer under SCHEMA's grammar: what every topology must give."""
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.engine.grammar import json_schema_grammar
    from common.request import Request
    from common.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01))
    ids, _ = processors["tiny"].apply([{"role": "user", "content": [{"type": "text", "text": "Describe it as JSON."}]}])
    request = Request("ref", ids, SamplingParams(max_tokens=60, temperature=0, grammar=json_schema_grammar(SCHEMA)))
    engine.add_request(request)
    while engine.has_unfinished:
        engine.step()
    return processors["tiny"].detokenize(request.output_token_ids)


def test_structured_output_is_json_of_the_schema_and_the_same_tokens_as_one_engine(server, structured_reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Describe it as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format=response_format
    )
    content = answer.choices[0].message.content
    value = json.loads(content)
    assert set(value) == {"answer", "ok"} and isinstance(value["ok"], bool) and len(value["answer"]) <= 12
    assert answer.choices[0].finish_reason == "stop" and content == structured_reference
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format=response_format, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content
    any_object = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0.8, seed=1, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    picked = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert picked.choices[0].message.content in ("red", "green", "blue")
    assert_pools_full(server, headers=AUTH)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "time_now",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo for two days?"}]


def _engine_answer(tiny_dir, processors, grammar: str, max_tokens: int) -> str:
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.request import Request
    from common.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01))
    ids, _ = processors["tiny"].apply(
        [{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}], tools=[WEATHER, CLOCK]
    )
    request = Request("ref", ids, SamplingParams(max_tokens=max_tokens, temperature=0, grammar=grammar))
    engine.add_request(request)
    while engine.has_unfinished:
        engine.step()
    return processors["tiny"].detokenize(request.output_token_ids)


@pytest.fixture(scope="module")
def tool_references(tiny_dir, processors):
    """One in-process engine's greedy answers for a named call and for one required call."""
    from services.gateway.tools import ToolChoice, tool_grammar

    named = tool_grammar(ToolChoice((WEATHER, CLOCK), "named", name="get_weather"))
    required = tool_grammar(ToolChoice((WEATHER, CLOCK), "required", parallel=False))
    auto = tool_grammar(ToolChoice((WEATHER, CLOCK), "auto"))
    return {
        "named": _engine_answer(tiny_dir, processors, named, 60),
        "required": _engine_answer(tiny_dir, processors, required, 80),
        "auto": _engine_answer(tiny_dir, processors, auto, 12),
    }


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """OpenAI's streamed tool-call deltas put back together, as a client does; and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_a_named_tool_call_is_that_call_with_arguments_of_its_parameters_and_one_engines_tokens(
    server, tool_references
):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=60, temperature=0)
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # as OpenAI answers a named call
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments == tool_references["named"]
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 9 and len(arguments["city"]) <= 8
    calls, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "stop" and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


def test_a_required_call_is_one_of_the_tools_finishing_as_tool_calls_whole_and_streamed(server, tool_references):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    reference = json.loads(tool_references["required"])
    assert [{"name": call.function.name, "parameters": json.loads(call.function.arguments)}] == reference
    calls, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    sampled = client.chat.completions.create(
        **{**kwargs, "temperature": 1.0, "seed": 7, "parallel_tool_calls": True, "max_tokens": 200}
    )
    made = sampled.choices[0].message.tool_calls or []
    complete = made if sampled.choices[0].finish_reason == "tool_calls" else made[:-1]  # max_tokens may cut the last
    for call in complete:  # whatever it sampled, each call is one of the tools' with its arguments
        assert call.function.name in ("get_weather", "time_now") and isinstance(
            json.loads(call.function.arguments), dict
        )
    assert_pools_full(server, headers=AUTH)


def test_auto_is_the_default_and_answers_in_text_when_the_model_opens_so_as_one_engine_does(server, tool_references):
    """(An answer that opens with `[{` is held to the calls' JSON: the grammar's own test, in test_tools.py.)"""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    kwargs = dict(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=12, temperature=0
    )  # "auto": the default
    answer = client.chat.completions.create(**kwargs).choices[0]
    reference = tool_references["auto"]
    assert not reference.startswith("[{")  # this model opens with text here
    assert answer.message.content == reference and answer.message.tool_calls is None
    streamed = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reference


def test_a_chat_that_carries_earlier_calls_and_tool_answers_is_served_and_counted_as_tokenize_counts_it(server):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo","days":2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, then rain"},
    ]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    counted = httpx.post(
        f"{server}/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER]}, headers=AUTH
    ).json()
    assert counted["count"] == answer.usage.prompt_tokens


def test_an_api_key_is_needed_everywhere_but_health_and_metrics_and_a_request_id_comes_back(server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        refused = httpx.post(f"{server}/v1/chat/completions", json=body, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError", headers
        assert refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server}/v1/models").status_code == 401 and httpx.get(f"{server}/stats").status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200 and httpx.get(f"{server}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="not-the-key").models.list()
    mine = {**AUTH, "X-Request-Id": "client-42"}
    answered = httpx.post(f"{server}/v1/chat/completions", json=body, headers=mine)
    assert answered.status_code == 200 and answered.headers["x-request-id"] == "client-42"
    assert answered.json()["id"].startswith("chatcmpl-")  # the answer's own id stays the gateway's
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True}, headers=mine) as streamed:
        assert streamed.headers["x-request-id"] == "client-42" and "[DONE]" in streamed.read().decode()
    bad = httpx.post(f"{server}/v1/chat/completions", json={**body, "model": "nope"}, headers=mine)
    assert bad.status_code == 404 and bad.headers["x-request-id"] == "client-42"
    assert (
        httpx.post(f"{server}/v1/chat/completions", json={"x": 1}, headers={"X-Request-Id": "id-9"}).headers[
            "x-request-id"
        ]
        == "id-9"
    )  # refused for its key, still answered with its id


def test_the_responses_api_gives_the_chats_tokens_whole_and_streamed_text_and_calls(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=8, temperature=0
    )
    answer = client.responses.create(
        model=MODEL, instructions="Be brief.", input=ASK[0]["content"], max_output_tokens=8, temperature=0
    )
    assert answer.output_text == chat.choices[0].message.content and answer.id.startswith("resp_")
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=ASK[0]["content"],
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert (
        kinds[:4]
        == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        and kinds[-1] == "response.incomplete"
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
    assert events[-1].response.output_text == answer.output_text
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **CLOCK["function"]}]
    required = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    called = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    (call,), (expected,) = called.output, required.choices[0].message.tool_calls
    assert call.type == "function_call" and called.status == "completed"
    assert (call.name, call.arguments, call.call_id.startswith("call_")) == (
        expected.function.name,
        expected.function.arguments,
        True,
    )
    streamed = list(
        client.responses.create(
            model=MODEL,
            input=ASK,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    pieces = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert pieces == call.arguments and streamed[-1].type == "response.completed"
    assert_pools_full(server, headers=AUTH)
