"""A chat template of the server's own (`--chat-template`) and a request's template variables (`chat_template_kwargs`):
the prompt is what transformers' `apply_chat_template` builds with the same template, tools and variables."""

import argparse
import json

import pytest
from starlette.testclient import TestClient

from common.model.processor import ChatProcessor
from epdmesh.options import add_chat_template_arg, chat_template
from services.gateway.app import build_app

TOOLS_TEMPLATE = (
    "{%- if tools %}SYSTEM: You may call: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n"
    "{% endif -%}"
    "{%- for message in messages -%}{{ message['role'] | upper }}: "
    "{%- for part in message['content'] -%}{%- if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}"
    "{% endif -%}{%- endfor -%}"
    "{%- for call in message.get('tool_calls') or [] %}<call>{{ call['function']['name'] }}"
    "{{ call['function']['arguments'] | tojson }}</call>{% endfor %}\n"
    "{%- endfor -%}{%- if add_generation_prompt %}ASSISTANT:{% if brief %} (briefly){% endif %}{% endif -%}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
    {
        "role": "assistant",
        "content": [],
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ],
    },
    {"role": "tool", "content": [{"type": "text", "text": "sunny"}]},
]


@pytest.fixture(scope="module")
def templated(tiny_dir):
    return ChatProcessor(tiny_dir, chat_template=TOOLS_TEMPLATE)


def _reference(processor, **kwargs) -> list[int]:
    return processor.processor.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True, chat_template=TOOLS_TEMPLATE, **kwargs
    )["input_ids"][0]


def test_the_servers_template_renders_tools_and_earlier_calls_as_transformers_does(templated, processors):
    ids, _ = templated.apply(CHAT, tools=[WEATHER])
    assert ids == _reference(processors["tiny"], tools=[WEATHER])
    text = templated.detokenize(ids)
    assert "You may call: get_weather" in text and '<call>get_weather{"city": "Oslo"}</call>' in text
    assert templated.count_prompt_tokens(CHAT, [WEATHER]) == len(ids)
    assert ids != processors["tiny"].apply(CHAT, tools=[WEATHER])[0]  # not the checkpoint's own template


def test_template_variables_reach_the_template_and_those_it_does_not_read_change_nothing(templated, processors):
    plain, _ = templated.apply(CHAT)
    brief, _ = templated.apply(CHAT, template_kwargs={"brief": True, "unused": 1})
    assert brief == _reference(processors["tiny"], brief=True) != plain
    assert "(briefly)" in templated.detokenize(brief)
    assert templated.apply(CHAT, template_kwargs={"unused": 1})[0] == plain
    assert "brief" in templated.template_variables and "messages" not in templated.template_variables
    assert templated.count_prompt_tokens(CHAT, None, {"brief": True}) == len(brief)
    with pytest.raises(ValueError, match="may not set add_generation_prompt"):
        templated.apply(CHAT, template_kwargs={"add_generation_prompt": False})


def test_a_template_that_cannot_render_a_chat_fails_at_start(tiny_dir):
    with pytest.raises(ValueError, match="cannot render a one-message chat"):
        ChatProcessor(tiny_dir, chat_template="{{ messages[5]['content'] }}")


def test_the_flag_takes_a_file_or_the_template_itself(tmp_path):
    parser = argparse.ArgumentParser()
    add_chat_template_arg(parser)
    path = tmp_path / "t.jinja"
    path.write_text(TOOLS_TEMPLATE)
    assert chat_template(parser.parse_args(["--chat-template", str(path)])) == TOOLS_TEMPLATE
    assert chat_template(parser.parse_args(["--chat-template", "{{ 'x' }}"])) == "{{ 'x' }}"
    assert chat_template(parser.parse_args([])) is None
    with pytest.raises(SystemExit, match="neither a file nor a Jinja template"):
        chat_template(parser.parse_args(["--chat-template", str(tmp_path / "missing.jinja")]))


class Backend:
    max_model_len = 4096

    def __init__(self, processor):
        self.processor = processor


def test_tokenize_and_a_request_take_chat_template_kwargs_and_refuse_what_the_server_sets(templated):
    client = TestClient(build_app(Backend(templated), "m"))
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    counted = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"brief": True}}).json()
    ids, _ = templated.apply(
        [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}], template_kwargs={"brief": True}
    )
    assert counted["tokens"] == ids
    for body in ({"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": [1]}):
        refused = client.post("/v1/chat/completions", content=json.dumps({"model": "m", "messages": messages, **body}))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_a_template_that_refuses_a_chat_is_the_clients_400_with_its_words(tiny_dir):
    strict = ChatProcessor(
        tiny_dir,
        chat_template=(
            "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool turns are not taken') }}"
            "{% endif %}{{ m['role'] }}{% endfor %}"
        ),
    )
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "tool", "content": [{"type": "text", "text": "y"}]},
    ]
    with pytest.raises(ValueError, match="the chat template refused the chat: tool turns are not taken"):
        strict.apply(chat)
    with pytest.raises(ValueError, match="tool turns are not taken"):
        strict.count_prompt_tokens(chat)
    client = TestClient(build_app(Backend(strict), "m"))
    refused = client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}
    )
    assert refused.status_code == 400 and "tool turns are not taken" in refused.json()["error"]["message"]


def test_the_tokenizers_special_tokens_are_not_a_requests_to_set(templated):
    with pytest.raises(ValueError, match="may not set eos_token"):
        templated.apply(CHAT, template_kwargs={"eos_token": "SYSTEM: "})
    client = TestClient(build_app(Backend(templated), "m"))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"bos_token": "x"}}
    assert client.post("/v1/chat/completions", content=json.dumps(body)).status_code == 400
