"""The Responses API's requests read as the chats they are (`services/gateway/openai_responses.py`), without a server."""

import base64
import io
import json

import pytest
from PIL import Image

from services.gateway.errors import ApiError
from services.gateway.openai_responses import parse_responses_request
from services.gateway.protocol import parse_chat_request

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}


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
    chat = _chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                 max_tokens=7, temperature=0.5, top_p=0.9, seed=3)
    assert read.conversation == chat.conversation and read.sampling == chat.sampling
    assert read.echo["instructions"] == "Be brief." and read.echo["max_output_tokens"] == 7
    items = _read(input=[{"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                                      {"type": "input_image", "image_url": _png()}]},
                         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A square."}]}])
    (user, assistant) = items.conversation
    assert [p["type"] for p in user["content"]] == ["text", "image"] and user["content"][1]["image"].size == (8, 6)
    assert assistant == {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}


def test_earlier_calls_and_their_outputs_become_one_assistant_turn_and_tool_turns():
    read = _read(input=[{"role": "user", "content": "Weather?"},
                        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
                        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                        {"type": "function_call_output", "call_id": "c2", "output": {"sky": "rain"}}],
                 tools=[WEATHER], tool_choice="none")
    _, calls, first, second = read.conversation
    assert [c["function"]["arguments"] for c in calls["tool_calls"]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert first == {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "c1"}
    assert second["content"][0]["text"] == '{"sky": "rain"}'


def test_text_format_tools_and_tool_choice_are_a_chats_constraint_and_tools():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    read = _read(input="x", text={"format": {"type": "json_schema", "name": "t", "schema": schema, "strict": True}})
    chat = _chat(messages=[{"role": "user", "content": "x"}],
                 response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    assert read.sampling.grammar == chat.sampling.grammar
    assert _read(input="x", text={"format": {"type": "text"}}).sampling.grammar is None
    named = _read(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert (named.tools.mode, named.tools.name) == ("named", "get_weather")
    assert named.tool_definitions[0]["function"]["parameters"] == WEATHER["parameters"]
    assert _read(input="x", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tools.parallel is False


@pytest.mark.parametrize("body, param, fragment", [
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
    ({"tools": [WEATHER]}, "tool_choice", "\"auto\""),
])
def test_what_cannot_be_served_as_asked_is_a_400_that_says_why(body, param, fragment):
    with pytest.raises(ApiError) as err:
        _read(**{"input": "x", **body})
    assert err.value.status == 400 and err.value.param == param and fragment in err.value.message, err.value.message
