"""Tool calling's parts that need no server: what a request's tools parse to, the grammar its answer is sampled under,
and how the answer's text becomes OpenAI's tool calls, whole and as it streams."""

import json

import llguidance
import pytest

from common.engine.grammar import json_schema_grammar
from services.gateway.errors import ApiError
from services.gateway.protocol import parse_chat_request
from services.gateway.tools import ToolCallStream, ToolChoice, finish_reason, message, tool_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "time-now"}}


def _chat(**extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_chat_request(json.dumps(body).encode(), ["m"])


def _refused(**extra) -> ApiError:
    with pytest.raises(ApiError) as err:
        _chat(**extra)
    assert err.value.status == 400
    return err.value


def test_each_tool_choice_parses_to_its_mode_and_a_left_out_one_is_auto():
    assert _chat().tools is None and _chat(tools=[]).tools is None
    none = _chat(tools=[WEATHER], tool_choice="none")
    assert none.tools.mode == "none" and not none.tools.calls and none.sampling.grammar is None
    assert none.tool_definitions == [WEATHER]
    required = _chat(tools=[WEATHER, CLOCK], tool_choice="required")
    assert required.tools.mode == "required" and required.tools.parallel and required.sampling.grammar
    named = _chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.tools.mode, named.tools.name) == ("named", "get_weather")
    assert named.sampling.grammar == json_schema_grammar(WEATHER["function"]["parameters"])
    assert not _chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tools.parallel
    for extra in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        auto = _chat(**extra)
        assert auto.tools.mode == "auto" and auto.tools.calls and auto.sampling.grammar


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"tool_choice": "required"}, "only allowed when 'tools' are given"),
        ({"tools": {"name": "f"}}, "must be a list"),
        ({"tools": [{"type": "function"}]}, "must be {type: function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "must be {type: function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "letters, digits"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "two tools are named 'get_weather'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "must be a JSON schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not among 'tools'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "true or false"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                "tool_choice": "required",
            },
            "cannot be followed",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "one structured-output constraint",
        ),
    ],
)
def test_tools_that_cannot_be_called_as_asked_are_a_400_that_says_why(extra, fragment):
    assert fragment in _refused(**extra).message


def test_a_text_completion_refuses_tools():
    from services.gateway.completions import parse_completion_request

    with pytest.raises(ApiError, match="for /v1/chat/completions"):
        parse_completion_request(json.dumps({"model": "m", "prompt": "x", "tools": [WEATHER]}).encode(), ["m"])


def _matches(grammar: str, text: str) -> bool:
    """`text` is what the grammar makes (fed byte by byte, as a byte-level tokenizer would)."""
    tokenizer = llguidance.TokenizerWrapper(_ByteTokenizer())
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tokenizer), grammar)
    for byte in text.encode():
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()


class _ByteTokenizer:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode()) if isinstance(text, str) else list(text)


def test_a_required_answer_is_a_list_of_calls_each_one_tools_with_its_arguments_and_one_call_without_parallel():
    tools = (WEATHER, CLOCK)
    grammar = tool_grammar(ToolChoice(tools, "required"))
    one = '[{"name":"get_weather","parameters":{"city":"Oslo","days":2}}]'
    two = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"time-now","parameters":{}}]'
    assert _matches(grammar, one) and _matches(grammar, two)
    for wrong in (
        "[]",
        '[{"name":"get_weather","parameters":{"days":2}}]',  # city is required
        '[{"name":"nope","parameters":{}}]',
        '[{"parameters":{},"name":"time-now"}]',
        '[{"name":"time-now","parameters":{},"extra":1}]',
        '{"name":"time-now","parameters":{}}',
    ):
        assert not _matches(grammar, wrong), wrong
    single = tool_grammar(ToolChoice(tools, "required", parallel=False))
    assert _matches(single, one) and not _matches(single, two)


def test_each_tools_definitions_stay_its_own_even_under_the_same_name():
    def tool(name, item):
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"$ref": "#/$defs/Item"}},
                    "required": ["x"],
                    "$defs": {"Item": item},
                },
            },
        }

    grammar = tool_grammar(ToolChoice((tool("a", {"type": "integer"}), tool("b", {"type": "string"})), "required"))
    assert _matches(grammar, '[{"name":"a","parameters":{"x":3}}]') and _matches(
        grammar, '[{"name":"b","parameters":{"x":"3"}}]'
    )
    assert not _matches(grammar, '[{"name":"a","parameters":{"x":"3"}}]')
    assert not _matches(grammar, '[{"name":"b","parameters":{"x":3}}]')


REQUIRED = (
    '[{"name":"get_weather","parameters":{"city":"O\\"s{l}o, [N]","days":2,"nested":{"a":[1,{"b":null}]}}},'
    '{"name":"time-now","parameters":{}}]'
)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, len(REQUIRED)])
def test_a_required_answer_streams_as_each_calls_id_and_name_then_its_arguments_whatever_the_pieces(piece):
    calls = ToolCallStream(ToolChoice((WEATHER, CLOCK), "required"))
    deltas = [d for i in range(0, len(REQUIRED), piece) for d in calls.feed(REQUIRED[i : i + piece])]
    made = calls.calls()
    assert [c["function"]["name"] for c in made] == ["get_weather", "time-now"]
    assert [json.loads(c["function"]["arguments"]) for c in made] == [p["parameters"] for p in json.loads(REQUIRED)]
    for index, call in enumerate(made):  # the deltas put together are the calls: the first names it, the rest add
        mine = [d for d in deltas if d["index"] == index]
        assert mine[0]["id"] == call["id"] and mine[0]["type"] == "function"
        assert mine[0]["function"]["name"] == call["function"]["name"]
        assert all("id" not in d and "name" not in d["function"] for d in mine[1:])
        assert "".join(d["function"]["arguments"] for d in mine) == call["function"]["arguments"]
    assert len({c["id"] for c in made}) == 2 and all(c["id"].startswith("call_") for c in made)


def test_a_named_answer_is_the_arguments_and_a_cut_answer_keeps_its_text():
    choice = ToolChoice((WEATHER,), "named", name="get_weather")
    calls = ToolCallStream(choice)
    first, rest = calls.feed('{"city":'), calls.feed('"Rome"}')
    assert first == [
        {
            "index": 0,
            "id": calls.calls()[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":'},
        }
    ]
    assert rest == [{"index": 0, "function": {"arguments": '"Rome"}'}}] and calls.feed("") == []
    whole = message(choice, '{"city":"Rome"}')
    assert whole["content"] is None and whole["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Rome"}',
    }
    cut = message(ToolChoice((WEATHER,), "required"), '[{"name":"get_wea')  # max_tokens ran out inside the name
    assert cut == {"role": "assistant", "content": '[{"name":"get_wea', "tool_calls": []}
    required = ToolChoice((WEATHER,), "required")
    assert finish_reason(required, "stop") == "tool_calls" and finish_reason(required, "length") == "length"
    assert finish_reason(choice, "stop") == "stop" and finish_reason(None, "stop") == "stop"


def test_earlier_calls_and_tool_answers_in_the_chat_are_taken_in_the_templates_form():
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat = _chat(messages=messages, tools=[WEATHER], tool_choice="none")
    assert chat.conversation[1] == {
        "role": "assistant",
        "content": [],
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ],
    }
    assert chat.conversation[2] == {
        "role": "tool",
        "content": [{"type": "text", "text": "sunny"}],
        "tool_call_id": "call_1",
    }
    for bad in (
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "assistant", "tool_calls": {"function": {}}},
        {"role": "tool", "content": "x", "tool_call_id": 3},
    ):
        with pytest.raises(ApiError) as err:
            _chat(messages=[bad])
        assert err.value.status == 400 and err.value.param == "messages"


def test_a_template_that_does_not_render_tool_calls_sees_them_as_the_json_a_required_answer_is(processors):
    processor = processors["tiny"]
    called = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [],
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}]},
    ]
    written = [
        called[0],
        {
            "role": "assistant",
            "content": [{"type": "text", "text": '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'}],
        },
        called[2],
    ]
    assert "tool_calls" not in processor.processor.chat_template
    ids, _ = processor.apply(called, tools=[WEATHER])
    assert (
        ids
        == processor.apply(written)[0]
        == processor.processor.apply_chat_template(
            written, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
    )
    assert processor.count_prompt_tokens(called, [WEATHER]) == len(ids)
    assert "TOOL: sunny" in processor.detokenize(ids)


def test_a_stop_string_or_token_that_cuts_a_required_answer_does_not_finish_it_as_tool_calls():
    required = ToolChoice((WEATHER,), "required")
    assert finish_reason(required, "stop", ",") == "stop" and finish_reason(required, "stop", 5) == "stop"
    assert finish_reason(required, "stop", None) == "tool_calls"


def _grammar_of(parameters: dict, mode: str = "required", strict: bool = False) -> str:
    function = {"name": "f", "parameters": parameters, **({"strict": True} if strict else {})}
    return tool_grammar(ToolChoice(({"type": "function", "function": function},), mode, name="f"))


def test_a_tools_references_into_itself_point_where_they_did_once_it_sits_in_the_list_of_calls():
    recursive = {
        "type": "object",
        "properties": {"c": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["c"],
        "additionalProperties": False,
    }
    grammar = _grammar_of(recursive)
    assert _matches(grammar, '[{"name":"f","parameters":{"c":{"c":null}}}]')
    assert not _matches(grammar, '[{"name":"f","parameters":{"c":[{"name":"f","parameters":{"c":null}}]}}]')
    pointer = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    assert _matches(_grammar_of(pointer), '[{"name":"f","parameters":{"a":1,"b":2}}]')
    assert not _matches(_grammar_of(pointer), '[{"name":"f","parameters":{"a":1,"b":"x"}}]')
    with_id = {
        "$id": "https://example.com/f.json",
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/B"}},
        "required": ["x"],
        "additionalProperties": False,
        "$defs": {"B": {"type": "boolean"}},
    }
    assert _matches(_grammar_of(with_id), '[{"name":"f","parameters":{"x":true}}]')


def test_a_strict_tool_takes_no_keys_its_schema_leaves_out_and_a_plain_one_does():
    open_object = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    for mode in ("required", "named"):
        extra = '{"x":true,"y":1}' if mode == "named" else '[{"name":"f","parameters":{"x":true,"y":1}}]'
        assert _matches(_grammar_of(open_object, mode), extra)
        assert not _matches(_grammar_of(open_object, mode, strict=True), extra)
    assert "additionalProperties" not in open_object  # the client's schema is not changed in place
    strict_format = _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": open_object}}
    ).sampling.grammar
    assert not _matches(strict_format, '{"x":true,"y":1}') and _matches(strict_format, '{"x":true}')


def test_a_schema_that_cannot_be_followed_is_a_400_naming_the_tool_and_odd_definitions_are_no_500():
    def tools(parameters):
        return [CLOCK, {"type": "function", "function": {"name": "g", "parameters": parameters}}]

    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        error = _refused(tools=tools({"type": "objectx"}), tool_choice=choice)
        assert "the parameters of 'g'" in error.message and error.param == "tools", error.message
        for odd in ({"type": "object", "$defs": [1]}, {"type": "object", "definitions": 3}):  # not schemas: unused
            assert _chat(tools=tools(odd), tool_choice=choice).sampling.grammar


def test_parameters_nested_too_deeply_are_a_400():
    deep: dict = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        assert _refused(tools=tools, tool_choice=choice).param == "tools"


def test_a_null_description_and_the_developer_role_are_taken():
    tool = {"type": "function", "function": {"name": "f", "description": None}}
    assert _chat(tools=[tool], tool_choice="required").tools.mode == "required"
    chat = _chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert chat.conversation[0]["role"] == "system"


def test_a_streamed_answer_cut_before_any_call_has_a_name_sends_its_text_as_the_whole_answer_does():
    import asyncio

    from common.engine.outputs import RequestOutput
    from common.request import RequestStatus
    from services.gateway.responses import sse

    text = '[{"n'
    chat = _chat(tools=[WEATHER], tool_choice="required", stream=True, max_tokens=len(text))

    async def outputs():
        for i in range(len(text)):
            last = i == len(text) - 1
            yield RequestOutput(
                "r",
                [i],
                list(range(i + 1)),
                RequestStatus.FINISHED_LENGTH if last else RequestStatus.DECODING,
                "length" if last else None,
                num_prompt_tokens=3,
            )

    async def main():
        return [
            w async for w in sse(chat, "chatcmpl-1", "m", 3, [outputs()], lambda ids: "".join(text[i] for i in ids))
        ]

    chunks = [
        json.loads(line[6:]) for w in asyncio.run(main()) for line in w.split("\n\n") if line.startswith("data: {")
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[-1] == {"content": text} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(not d.get("tool_calls") and not d.get("content") for d in deltas[:-1])


def test_earlier_calls_arguments_and_the_tools_count_as_the_prompts_text():
    plain = _chat(messages=[{"role": "user", "content": "hi"}])
    big = "x" * 5000
    called = _chat(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": big})}}
                ],
            },
        ]
    )
    assert called.num_text_chars >= plain.num_text_chars + 5000 and not called.short_text
    tooled = _chat(tools=[{"type": "function", "function": {"name": "f", "description": big}}], tool_choice="none")
    assert tooled.num_text_chars >= plain.num_text_chars + 5000


def test_a_lone_surrogate_in_a_message_is_a_400_that_says_so():
    body = '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    with pytest.raises(ApiError, match="lone UTF-16 surrogate"):
        parse_chat_request(body.encode(), ["m"])


def test_a_body_that_builds_a_big_grammar_is_parsed_off_the_event_loop():
    from services.gateway.app import _parse_in_thread

    many = json.dumps({"model": "m", "messages": [], "tools": [WEATHER] * 20, "tool_choice": "required"}).encode()
    assert len(many) > 2048 and _parse_in_thread(many)
    assert not _parse_in_thread(json.dumps({"model": "m", "tools": [WEATHER], "tool_choice": "required"}).encode())
    assert not _parse_in_thread(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    )
    assert _parse_in_thread(b"x" * (65 * 1024))


def test_an_auto_answer_is_text_unless_it_opens_as_the_calls_do_and_then_it_is_held_to_them():
    from services.gateway.tools import AnswerDeltas

    grammar = tool_grammar(ToolChoice((WEATHER, CLOCK), "auto"))
    for text in ("", "Sunny.", "[1] a citation", "[", "a [{ in the middle", '[{"name":"time-now","parameters":{}}]'):
        assert _matches(grammar, text), text
    for text in ('[{"name":"nope","parameters":{}}]', '[{"name":"time-now","parameters":{}}] and text', "[{x"):
        assert not _matches(grammar, text), text
    choice = ToolChoice((WEATHER, CLOCK), "auto")
    text = AnswerDeltas(choice)
    assert [text.feed(p) for p in ("[", "1] a")] == [{}, {"content": "[1] a"}] and text.last(" b", "[1] a b") == {
        "content": " b"
    }
    calls = AnswerDeltas(choice)
    assert calls.feed("[") == {} and calls.feed('{"name":"time-now",') == {
        "tool_calls": [
            {
                "index": 0,
                "id": calls.calls.calls()[0]["id"],
                "type": "function",
                "function": {"name": "time-now", "arguments": ""},
            }
        ]
    }
    assert AnswerDeltas(choice).last("[", "[") == {"content": "["}  # ended holding its first character
    assert message(choice, "Sunny.") == {"role": "assistant", "content": "Sunny."}
    assert message(choice, '[{"name":"time-now","parameters":{}}]')["tool_calls"][0]["function"]["name"] == "time-now"
    assert finish_reason(choice, "stop", None, "Sunny.") == "stop"
    assert finish_reason(choice, "stop", None, '[{"name":"time-now","parameters":{}}]') == "tool_calls"


def test_an_auto_answer_that_opened_with_the_calls_json_is_held_to_a_tools_call_by_the_engine(tiny_dir, processors):
    """The engine's side of auto: a continuation whose answer so far is `[{` (as a migrated request's is) samples
    on to a whole call of one of the tools."""
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.request import Request
    from common.sampling import SamplingParams

    processor = processors["tiny"]
    tight = {
        "type": "object",
        "properties": {"c": {"enum": ["a", "b"]}},
        "required": ["c"],
        "additionalProperties": False,
    }
    tools = tuple({"type": "function", "function": {"name": name, "parameters": tight}} for name in ("pick", "other"))
    choice = ToolChoice(tools, "auto", parallel=False)
    prompt, _ = processor.apply(
        [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}], tools=list(choice.tools)
    )
    opened = processor.tokenizer.convert_tokens_to_ids(["[", "{"])
    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01), detokenize=processor.detokenize)
    request = Request(
        "auto",
        prompt + opened,
        SamplingParams(max_tokens=150, temperature=0, grammar=tool_grammar(choice)),
        num_continued_tokens=2,
    )
    engine.add_request(request)
    while engine.has_unfinished:
        engine.step()
    answer = processor.detokenize(opened + request.output_token_ids)
    assert request.finish_reason == "stop" and answer.startswith("[{")
    (call,) = json.loads(answer)
    assert call["name"] in ("pick", "other") and call["parameters"]["c"] in ("a", "b")
    assert finish_reason(choice, "stop", None, answer) == "tool_calls"
    assert message(choice, answer)["tool_calls"][0]["function"]["name"] == call["name"]
