"""Tool calling (OpenAI's `tools` and `tool_choice`) by structured output, as vLLM serves it without a tool-call parser:

  tool_choice {"type": "function", "function": {"name": N}}  the answer is a call of N: its arguments, JSON that
                                                               matches N's `parameters` (finish reason "stop")
  tool_choice "required"   one or more calls, each of one of the tools, with arguments that match its parameters
                           (finish reason "tool_calls"; `parallel_tool_calls: false`: exactly one)
  tool_choice "none"       plain text
  tool_choice "auto"       (OpenAI's default when tools are sent) text, or calls as "required" makes them: the model
                           decides by its first characters — an answer that opens with `[{` is the calls' JSON,
                           held to it from there (finish reason "tool_calls"); any other is text (one that opens
                           with `[{` and is not a call cannot be sampled). No model-specific format or parser: a
                           template that shows the model its tools and this format (`--chat-template`) is what
                           makes it call them

The tools go to the chat template as Hugging Face's `apply_chat_template(tools=...)` takes them; a template that
does not render them (LLaVA-1.5's) leaves the model unaware of them, and the grammar alone makes the call valid: a
valid call, not necessarily a good one (vLLM's documentation says the same of its named calls).

A "required" answer is sampled as compact JSON, `[{"name":"get_weather","parameters":{...}},...]` (each tool's
schema under the grammar's `$defs`, its references into itself rebased there), and `ToolCallStream` turns that text
into OpenAI's `tool_calls` as it comes: a call's id and name once its name is complete, then its arguments' text
piece by piece. A tool with `"strict": true` takes no keys its schema leaves out. A stop string or token of the
request's ends the answer where it matches, even inside a call: then the finish reason is "stop" with its
`stop_reason`, never "tool_calls".
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from common.engine.grammar import GrammarRejected, json_schema_grammar
from services.gateway.errors import ApiError
from services.gateway.structured import strict_schema

MAX_TOOLS = 128  # as OpenAI allows
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolChoice:
    tools: tuple[dict, ...]  # the request's tools as the chat template takes them
    mode: str  # "none", "auto", "named" or "required"
    name: str | None = None  # named: the function called
    parallel: bool = True  # required / auto: more than one call allowed
    text_chars: int = 0  # the tools' definitions as JSON text, which a template may render (counted once, at parse)

    @property
    def calls(self) -> bool:
        """The answer is tool calls, not text."""
        return self.mode != "none"

    @property
    def definitions(self) -> list[dict] | None:
        return list(self.tools) or None

    def parameters(self, name: str) -> dict:
        """The tool's parameters schema; with `"strict": true`, no object in it takes keys it does not list (OpenAI's
        promise for a strict tool, kept here by the grammar rather than by refusing a schema that leaves it open)."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        schema = function.get("parameters") or NO_PARAMETERS
        return strict_schema(schema) if function.get("strict") is True else schema


def parse_tools(body: dict) -> ToolChoice | None:
    """The request's tools and how they are to be called; None when it sends none."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise ApiError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list of {type: function, function: {name, parameters}}", "tools")
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    tools = _checked_tools(tools)
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("none", "required", "auto"):  # left out: "auto", as OpenAI defaults it
        return ToolChoice(tools, choice or "auto", parallel=parallel is not False, text_chars=len(json.dumps(tools)))
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
        else None
    )
    if not isinstance(name, str):
        raise ApiError(
            400,
            '\'tool_choice\' must be "none", "required", "auto" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise ApiError(
            400,
            f"tool_choice names the function {name!r}, which is not among 'tools' ({', '.join(names)})",
            "tool_choice",
        )
    return ToolChoice(tools, "named", name=name, text_chars=len(json.dumps(tools)))


def _checked_tools(tools) -> tuple[dict, ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of up to {MAX_TOOLS} tools", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ApiError(
                400, f"{where} must be {{type: function, function: {{name, description, parameters}}}}", "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ApiError(
                400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", "tools"
            )
        if name in seen:
            raise ApiError(400, f"{where}: two tools are named {name!r}", "tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema (an object)", "tools")
        if not isinstance(function.get("description") or "", str):
            raise ApiError(400, f"{where}.function.description must be a string", "tools")
        out.append(
            {
                "type": "function",
                "function": {k: v for k, v in function.items() if k in ("name", "description", "parameters", "strict")},
            }
        )
    return tuple(out)


def tool_grammar(choice: ToolChoice | None) -> str | None:
    """The grammar an answer that calls tools is sampled under; None for plain text."""
    if choice is None or not choice.calls:
        return None
    try:
        if choice.mode == "named":
            return _compiled(choice.parameters(choice.name), f"the parameters of {choice.name!r}")
        try:
            if choice.mode == "auto":
                return _text_or_calls(_calls_schema(choice))
            return json_schema_grammar(_calls_schema(choice))
        except GrammarRejected as e:
            for tool in choice.tools:  # say which tool's schema it is
                name = tool["function"]["name"]
                _compiled(choice.parameters(name), f"the parameters of {name!r}")
            raise ApiError(
                400, f"the tools' parameters cannot be followed together as a JSON schema: {e}", "tools"
            ) from None
    except RecursionError:
        raise ApiError(400, "a tool's parameters nest too deeply to follow", "tools") from None


CALLS_OPEN = "[{"
# text: anything that does not open as the calls do ("[" alone, "[1] ...", "a [{...": all text)
TEXT = r"/[^\[](?s:.*)|\[|\[[^{](?s:.*)/"


def _text_or_calls(schema: dict) -> str:
    """An "auto" answer's grammar: nothing, text, or the calls' compact JSON (`schema`), which is what an answer that
    opens with `[{` must be."""
    import llguidance

    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(
            f'start: calls | TEXT | ""\ncalls: %json {json.dumps(schema)}\nTEXT: {TEXT}\n'
        )
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarRejected(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarRejected(error)
    return grammar


def answered_calls(choice: ToolChoice | None, text: str) -> bool:
    """The answer is tool calls (not text): always under "required" or a named call; under "auto", if it opens so."""
    if choice is None or not choice.calls:
        return False
    return choice.mode != "auto" or text.startswith(CALLS_OPEN)


def _compiled(schema: dict, where: str) -> str:
    try:
        return json_schema_grammar(schema)
    except GrammarRejected as e:
        raise ApiError(400, f"{where} cannot be followed as a JSON schema: {e}", "tools") from None


def _calls_schema(choice: ToolChoice) -> dict:
    """A JSON array of calls, each {"name": <a tool's name>, "parameters": <its arguments>}, the name first. Each
    tool's schema sits under the top's `$defs` as `tool_<i>`, its own references into itself (`#`, `#/$defs/...`,
    `#/properties/...`) rebased there, so they point where they pointed in the schema the client sent."""
    defs: dict[str, dict] = {}
    calls = []
    for i, tool in enumerate(choice.tools):
        name = tool["function"]["name"]
        base = f"#/$defs/tool_{i}"
        parameters = _rebased(choice.parameters(name), base)
        parameters.pop("$id", None)  # its references now resolve against the top
        parameters.pop("$schema", None)
        defs[f"tool_{i}"] = parameters
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": {"$ref": base}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": defs}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def _rebased(node, base: str):
    """A copy of a schema whose local references (`"$ref": "#..."`) point under `base` instead of at its root."""
    if isinstance(node, dict):
        return {
            key: base + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rebased(value, base)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rebased(value, base) for value in node]
    return node


def finish_reason(choice: ToolChoice | None, reason: str | None, stop_reason=None, text: str = "") -> str | None:
    """As OpenAI and vLLM answer: "tool_calls" for calls of a "required" or "auto" answer (`text`) that its grammar
    ended (not a stop string or token of the request's, `stop_reason`, which can cut a call short), "stop" for a
    named one (the caller asked for that call), else the engine's reason."""
    if (
        choice is not None
        and choice.mode in ("required", "auto")
        and answered_calls(choice, text)
        and reason == "stop"
        and stop_reason is None
    ):
        return "tool_calls"
    return reason


def message(choice: ToolChoice, text: str) -> dict:
    """A whole answer's assistant message: its calls, and no content. An answer cut before any call's name was
    complete (max_tokens) keeps its text as content (streamed too); a later call cut inside its name is left out
    (the finish reason, "length", says the answer was cut). An "auto" answer in text is that text."""
    if not answered_calls(choice, text):
        return {"role": "assistant", "content": text}
    made = calls_in(choice, text)
    if not made:
        return {"role": "assistant", "content": text, "tool_calls": []}
    return {"role": "assistant", "content": None, "tool_calls": made}


def calls_in(choice: ToolChoice | None, text: str) -> list[dict]:
    """A whole answer's tool calls (those with a name), in OpenAI's `tool_calls` form; none for a text answer."""
    if not answered_calls(choice, text):
        return []
    calls = ToolCallStream(choice)
    calls.feed(text)
    return calls.calls()


@dataclasses.dataclass(slots=True)
class _Call:
    id: str
    name: str | None = None
    arguments: str = ""
    sent: int = -1  # characters of the arguments sent; -1: not announced (its id and name not sent yet)


class ToolCallStream:
    """A tool-calling answer's text → OpenAI's tool calls, fed as it comes. Named: the text is the arguments.
    Required: the compact JSON array the grammar makes is scanned character by character (no re-parse per piece)."""

    def __init__(self, choice: ToolChoice):
        self.named = choice.mode == "named"
        self._calls: list[_Call] = [_Call(_call_id(), choice.name)] if self.named else []
        self._depth = 0  # containers open, outside strings
        self._in_string = self._escaped = False
        self._target = None  # where a string's characters go: "key", "name", "arguments" or None
        self._key = self._name = ""
        self._field: str | None = None  # the call object's key whose value is being read
        self._expect_key = False

    def feed(self, text: str) -> list[dict]:
        """OpenAI's `delta.tool_calls` entries for `text`, the next piece of the answer (empty: nothing new)."""
        if self.named:
            self._calls[0].arguments += text
        else:
            for c in text:
                self._char(c)
        return self._deltas()

    def calls(self) -> list[dict]:
        """Every call with a name so far, in OpenAI's `message.tool_calls` form."""
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self._calls
            if c.name is not None
        ]

    def _deltas(self) -> list[dict]:
        out = []
        for index, call in enumerate(self._calls):
            if call.name is None:
                continue
            if call.sent < 0:
                out.append(
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
            elif len(call.arguments) > call.sent:
                out.append({"index": index, "function": {"arguments": call.arguments[call.sent :]}})
            call.sent = len(call.arguments)
        return out

    def _char(self, c: str) -> None:
        call = self._calls[-1] if self._calls else None
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                self._string_closed(call)
                if self._target == "arguments":
                    call.arguments += c
                return
            if self._target == "arguments":
                call.arguments += c
            elif self._target == "key":
                self._key += c
            elif self._target == "name":
                self._name += c
            return
        if c == '"':
            self._in_string = True
            if self._depth == 2 and self._expect_key:
                self._target, self._key = "key", ""
            elif self._depth == 2 and self._field == "name":
                self._target, self._name = "name", ""
            elif self._field == "parameters":
                self._target = "arguments"
                call.arguments += c
            else:
                self._target = None
            return
        if self._depth >= 3:  # inside the arguments' own objects and arrays
            if self._field == "parameters":
                call.arguments += c
            if c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
        elif self._depth == 2:  # at the level of a call object's keys
            if c == ":":
                self._field, self._expect_key = self._key, False
            elif c == ",":
                self._field, self._expect_key = None, True
            elif c == "}":
                self._field, self._depth = None, 1
            else:
                if c in "{[":
                    self._depth = 3
                if self._field == "parameters":
                    call.arguments += c
        elif self._depth == 1 and c == "{":
            self._calls.append(_Call(_call_id()))
            self._depth, self._field, self._expect_key = 2, None, True
        elif self._depth == 1 and c == "]":
            self._depth = 0
        elif self._depth == 0 and c == "[":
            self._depth = 1

    def _string_closed(self, call: _Call) -> None:
        if self._target == "key":
            self._key = _unquote(self._key)
        elif self._target == "name":
            call.name = _unquote(self._name)


def _unquote(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class AnswerDeltas:
    """A tool-calling answer's text, piece by piece, as a chat delta each: `tool_calls`, or — an "auto" answer that
    did not open as calls — `content`. An "auto" answer's first character is held until the second tells which."""

    def __init__(self, choice: ToolChoice):
        self.calls = ToolCallStream(choice)
        self.text_mode: bool | None = None if choice.mode == "auto" else False
        self._held = ""

    def feed(self, piece: str) -> dict:
        if self.text_mode is None:
            self._held += piece
            if self._held in ("", "["):
                return {}
            self.text_mode, piece, self._held = not self._held.startswith(CALLS_OPEN), self._held, ""
        if self.text_mode:
            return {"content": piece} if piece else {}
        made = self.calls.feed(piece)
        return {"tool_calls": made} if made else {}

    def last(self, piece: str, whole: str) -> dict:
        """The last piece's delta, given the whole answer: text held back goes out, and calls that never got a name
        (cut by max_tokens) go out as the text they were, so nothing generated is lost."""
        delta = self.feed(piece)
        if self.text_mode is None:  # it ended holding "[" (or nothing)
            return {"content": self._held} if self._held else {}
        if not self.text_mode and not self.calls.calls():
            return {"content": whole}
        return delta
