"""The Responses API's requests read as the chats they are (`services/gateway/responses_request.py`) and their answers
(`services/gateway/openai_responses.py`), no server."""

import base64
import io
import json

import pytest
from PIL import Image

from services.gateway.errors import ApiError
from services.gateway.protocol import parse_chat_request
from services.gateway.responses_request import parse_responses_request

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]},
}


def _read(**body):
    return parse_responses_request(json.dumps({"model": "m", **body}).encode(), ["m"])


def _chat(**body):
    return parse_chat_request(json.dumps({"model": "m", **body}).encode(), ["m"])


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 20, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_input_instructions_and_sampling_read_as_the_chat_they_are():
    read = _read(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3)
    chat = _chat(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
    )
    assert read.conversation == chat.conversation and read.sampling == chat.sampling
    assert read.echo["instructions"] == "Be brief." and read.echo["max_output_tokens"] == 7
    items = _read(
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is it?"},
                    {"type": "input_image", "image_url": _png()},
                ],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A square."}]},
        ]
    )
    (user, assistant) = items.conversation
    assert [p["type"] for p in user["content"]] == ["text", "image"] and user["content"][1]["image"].size == (8, 6)
    assert assistant == {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}


def test_earlier_calls_and_their_outputs_become_one_assistant_turn_and_tool_turns():
    read = _read(
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": {"sky": "rain"}},
        ],
        tools=[WEATHER],
        tool_choice="none",
    )
    _, calls, first, second = read.conversation
    assert [c["function"]["arguments"] for c in calls["tool_calls"]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert first == {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "c1"}
    assert second["content"][0]["text"] == '{"sky": "rain"}'


def test_text_format_tools_and_tool_choice_are_a_chats_constraint_and_tools():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    read = _read(input="x", text={"format": {"type": "json_schema", "name": "t", "schema": schema, "strict": True}})
    chat = _chat(
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}},
    )
    assert read.sampling.grammar == chat.sampling.grammar
    assert _read(input="x", text={"format": {"type": "text"}}).sampling.grammar is None
    named = _read(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert (named.tools.mode, named.tools.name) == ("named", "get_weather")
    assert named.tool_definitions[0]["function"]["parameters"] == WEATHER["parameters"]
    assert _read(input="x", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tools.parallel is False


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"background": True}, "background", "not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"truncation": "auto"}, "truncation", "not cut"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools", "only function tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "function_call_output item"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input", "file ids"),
        ({"input": []}, "input", "non-empty list"),
        ({"instructions": ["x"]}, "instructions", "must be a string"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '{"type": "function", "name": ...}'),
    ],
)
def test_what_cannot_be_served_as_asked_is_a_400_that_says_why(body, param, fragment):
    with pytest.raises(ApiError) as err:
        _read(**{"input": "x", **body})
    assert err.value.status == 400 and err.value.param == param and fragment in err.value.message, err.value.message


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "function_call_output item"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "needs the call_id"),
        ({"input": [{"type": "function_call", "call_id": 3, "name": "f"}]}, "input", "call_id and name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs its 'schema'"),
        ({"text": {"format": {"type": "json_object", "strict": "yes"}}}, "text", "true or false"),
        ({"metadata": "x"}, "metadata", "an object"),
        ({"truncation": 1}, "truncation", 'must be "disabled"'),
    ],
)
def test_items_and_fields_the_responses_api_does_not_take_are_a_400(body, param, fragment):
    with pytest.raises(ApiError) as err:
        _read(**{"input": "x", **body})
    assert err.value.param == param and fragment in err.value.message, err.value.message


def test_an_error_from_the_chat_path_names_the_responses_fields_and_input_items():
    with pytest.raises(ApiError) as err:
        _read(input="x", max_output_tokens="ten")
    assert err.value.param == "max_output_tokens" and "'max_output_tokens'" in err.value.message
    with pytest.raises(ApiError) as err:  # instructions come first, and the two calls are one chat message
        _read(
            instructions="Be brief.",
            input=[
                {"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{bad"},
            ],
        )
    assert err.value.param == "input" and err.value.message.startswith("input[2]"), err.value.message
    with pytest.raises(ApiError) as err:
        _read(input="x", tools=[WEATHER], tool_choice={"type": "function"})
    assert '{"type": "function", "name": ...}' in err.value.message and '"function": {' not in err.value.message


def _outputs(texts: list[str], reason: str):
    from common.engine.outputs import RequestOutput
    from common.request import RequestStatus

    async def gen():
        for i in range(len(texts)):
            last = i == len(texts) - 1
            yield RequestOutput(
                "r",
                [i],
                list(range(i + 1)),
                RequestStatus.FINISHED_LENGTH
                if last and reason == "length"
                else RequestStatus.FINISHED_STOPPED
                if last
                else RequestStatus.DECODING,
                reason if last else None,
                num_prompt_tokens=4,
            )

    return gen()


def _events(read, texts, reason):
    import asyncio

    from services.gateway.openai_responses import stream

    async def main():
        return [
            w
            async for w in stream(
                read, "resp-abc", "m", 4, [_outputs(texts, reason)], lambda ids: "".join(texts[i] for i in ids)
            )
        ]

    return [json.loads(line.split("data: ", 1)[1]) for w in asyncio.run(main()) for line in w.split("\n\n") if line]


def test_streamed_calls_close_one_before_the_next_opens_and_a_cut_one_is_incomplete():
    from services.gateway.openai_responses import whole

    read = _read(input="x", tools=[WEATHER, {"type": "function", "name": "now"}], tool_choice="required")
    texts = ['[{"name":"now",', '"parameters":{}}', ',{"name":"get_weather",', '"parameters":{"city":"Os']
    events = _events(read, texts, "length")
    kinds = [(e["type"], e.get("output_index")) for e in events if "output_item" in e["type"] or ".done" in e["type"]]
    assert kinds == [
        ("response.output_item.added", 0),
        ("response.function_call_arguments.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
    ]
    final = events[-1]
    assert final["type"] == "response.incomplete" and [i["status"] for i in final["response"]["output"]] == [
        "completed",
        "incomplete",
    ]
    from common.engine.outputs import RequestOutput
    from common.request import RequestStatus

    out = RequestOutput("r", [3], [0, 1, 2, 3], RequestStatus.FINISHED_LENGTH, "length", num_prompt_tokens=4)
    body = whole(read, "resp-abc", "m", 4, [(out, [])], lambda ids: "".join(texts[i] for i in ids), False)

    def unnamed(items):  # call ids are drawn per answer
        return [{k: v for k, v in item.items() if k != "call_id"} for item in items]

    assert unnamed(body["output"]) == unnamed(final["response"]["output"]) and body["status"] == "incomplete"
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
