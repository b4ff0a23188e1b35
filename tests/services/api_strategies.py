"""Hypothesis strategies for the HTTP API's request bodies: well-formed chats that reach the engine (images, tools,
structured output, every sampling parameter near the edges of its range), the same with one or two values replaced
by arbitrary JSON or removed, and bodies that are mostly noise. `tests/services/test_api_fuzz.py` sends them."""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
from hypothesis import strategies as st
from PIL import Image

from tests.services.servers import MODEL

scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
noise = st.recursive(
    scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)
ident = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True)


def encoded_image(width: int, height: int, mode: str, fmt: str) -> bytes:
    """An image file of that size, pixel mode and format (PNG where the format cannot hold the mode)."""
    rgb = Image.fromarray((np.random.RandomState(width * 7 + height).rand(height, width, 3) * 255).astype("uint8"))
    converted = rgb.convert(mode)
    for img, fmt_ in ((converted, fmt), (converted, "PNG"), (rgb, "PNG")):  # an RGB PNG always saves
        buf = io.BytesIO()
        try:
            img.save(buf, fmt_)
            return buf.getvalue()
        except (OSError, KeyError, ValueError):
            continue
    raise AssertionError("unreachable")


def data_uri(data: bytes, mime: str, valid_base64: bool = True) -> str:
    encoded = base64.b64encode(data).decode()
    return f"data:{mime};base64,{encoded if valid_base64 else encoded[:-1] + '!'}"


image_file = st.builds(
    encoded_image,
    st.integers(1, 400),
    st.integers(1, 400),
    st.sampled_from(["RGB", "L", "RGBA", "P", "CMYK", "I;16", "1", "LA"]),
    st.sampled_from(["PNG", "GIF", "BMP", "TIFF", "WEBP", "JPEG"]),
)
broken_image = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda data, cut: data[:cut],
        st.builds(encoded_image, st.just(32), st.just(32), st.just("RGB"), st.just("PNG")),
        st.integers(0, 200),
    ),
)
valid_image_url = st.builds(data_uri, image_file, st.sampled_from(["image/png", "image/jpeg", "image/webp"]))
image_url = st.one_of(
    valid_image_url,
    valid_image_url,
    valid_image_url,
    st.builds(data_uri, broken_image, st.sampled_from(["image/png", "text/plain", ""]), st.booleans()),
    st.sampled_from(["http://127.0.0.1:9/x.png", "https://[::1", "ftp://x", "", "data:", "data:image/png;base64,"]),
)
text = st.one_of(
    st.text(max_size=40).filter(lambda t: "<image>" not in t),
    st.sampled_from(["Describe it.", "USER:", "ASSISTANT:", "<s></s>", "a" * 3000, "\x00"]),
)

schema_leaf = st.sampled_from(
    [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"enum": ["a", 1, None]},
        {"const": "x"},
        {"type": "string", "pattern": "[a-c]{2,3}"},
        {"type": "string", "pattern": "("},
        {"type": "string", "maxLength": 3},
        {"type": "integer", "minimum": 5, "maximum": 2},
        {"$ref": "#/$defs/x"},
        {"$ref": "#"},
        {"type": "string", "format": "date-time"},
        {},
        True,
        False,
        {"type": ["string", "null"]},
        {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 1},
    ]
)
schema = st.recursive(
    schema_leaf,
    lambda inner: st.one_of(
        st.builds(
            lambda props, extra: {
                "type": "object",
                "properties": props,
                "required": sorted(props)[:1],
                "additionalProperties": extra,
            },
            st.dictionaries(ident, inner, max_size=3),
            st.booleans(),
        ),
        st.builds(lambda items: {"type": "array", "items": items}, inner),
        st.builds(lambda options: {"oneOf": options}, st.lists(inner, max_size=3)),
        st.builds(lambda parts, defined: {"allOf": parts, "$defs": {"x": defined}}, st.lists(inner, max_size=2), inner),
    ),
    max_leaves=6,
)
object_schema = st.builds(
    lambda props: {"type": "object", "properties": props}, st.dictionaries(ident, schema, max_size=3)
)


def within(low: float, high: float, *edges: float):
    """A float the API accepts for the parameter, its edges and the smallest positive ones more often than chance."""
    return st.one_of(st.floats(low, high), st.sampled_from([low, high, *edges]))


SAMPLING = {
    "max_tokens": st.integers(1, 12),
    "max_completion_tokens": st.integers(1, 12),
    "temperature": within(0, 2, 1e-300, 5e-324, 1e-5, 0.7),
    "top_p": within(5e-324, 1, 1e-300, 0.9),
    "top_k": st.integers(-1, 50),
    "min_p": within(0, 1, 5e-324),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 4000), max_size=3),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "logprobs": st.booleans(),
    "presence_penalty": within(-2, 2, 5e-324),
    "frequency_penalty": within(-2, 2, 5e-324),
    "repetition_penalty": within(5e-324, 100, 1e-224, 1),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 4000).map(str), st.floats(-100, 100), max_size=3),
    "return_token_ids": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=8),
    "slo": st.fixed_dictionaries({}, optional={"ttft_ms": within(5e-324, 1e5, 1e-300), "tbt_ms": within(5e-324, 1e5)}),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "messages", "bos_token", "x", "date"]), scalar, max_size=2
    ),
}


@st.composite
def some_of(draw, fields: dict, most: int = 4) -> dict:
    """Up to `most` of the fields, each with a value of its strategy (a body with all of them is never served);
    stream_options come with "stream": true, as they must."""
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True))
    chosen = {name: draw(fields[name]) for name in names}
    return {**chosen, "stream": True} if "stream_options" in chosen else chosen


@st.composite
def conversations(draw) -> list[dict]:
    """1-4 messages a chat template takes: images in user messages only, an earlier tool call answered."""
    messages = []
    for i in range(draw(st.integers(1, 4))):
        role = draw(st.sampled_from(["user", "user", "system", "assistant", "developer"])) if i < 3 else "user"
        if role == "user":
            parts = draw(
                st.lists(
                    st.one_of(
                        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                        st.fixed_dictionaries(
                            {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_url})}
                        ),
                    ),
                    min_size=1,
                    max_size=3,
                )
            )
            messages.append({"role": role, "content": draw(st.one_of(st.just(parts), text))})
        elif role == "assistant" and draw(st.booleans()):
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": draw(ident), "arguments": "{}"}}
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": "c1", "content": draw(text)})
        else:
            messages.append({"role": role, "content": draw(text)})
    return messages


@st.composite
def chat_bodies(draw) -> dict:
    """A chat the API should serve, or refuse only for a value at the edge of its range."""
    messages = draw(conversations())
    body = {"model": MODEL, "messages": messages, **draw(some_of(SAMPLING))}
    if body.get("logprobs") is True and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(0, 20))
    constraint = draw(
        st.sampled_from(["none", "none", "tools", "response_format", "guided_json", "guided_regex", "guided_choice"])
    )
    if constraint == "tools":
        tools = draw(
            st.lists(
                st.builds(
                    lambda n, p, strict: {
                        "type": "function",
                        "function": {"name": n, "parameters": p, "strict": strict},
                    },
                    ident,
                    object_schema,
                    st.booleans(),
                ),
                min_size=1,
                max_size=3,
                unique_by=lambda t: t["function"]["name"],
            )
        )
        first = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        body.update(
            tools=tools,
            tool_choice=draw(st.sampled_from(["auto", "none", "required", first])),
            max_tokens=draw(st.integers(1, 40)),
        )
    elif constraint == "response_format":
        body["response_format"] = draw(
            st.one_of(
                st.just({"type": "json_object"}),
                st.builds(
                    lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                    st.one_of(object_schema, object_schema, schema),
                ),
            )
        )
        body["max_tokens"] = draw(st.integers(1, 40))
    elif constraint == "guided_json":
        body["guided_json"] = draw(schema)
    elif constraint == "guided_regex":
        body["guided_regex"] = draw(st.sampled_from(["[a-z]+", "(", "a{3}", "", ".*", r"\d{2,1}", r"[^\x00-\x7f]{3}"]))
    elif constraint == "guided_choice":
        body["guided_choice"] = draw(st.lists(st.text(max_size=4), max_size=3))
    return body


def _paths(obj, prefix=()):
    yield prefix
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in children:
        yield from _paths(value, prefix + (key,))


@st.composite
def mutated(draw, bodies) -> dict:
    """A body with one or two values (anywhere in it) replaced by arbitrary JSON, or removed."""
    body = copy.deepcopy(draw(bodies))  # hypothesis may hand the same object out again
    for _ in range(draw(st.integers(1, 2))):
        paths = [p for p in _paths(body) if p]
        if not paths:  # the first mutation removed the only field
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(noise)
    return body


completion_bodies = st.builds(
    lambda prompt, extra: {"model": MODEL, "prompt": prompt, **extra},
    st.one_of(text.filter(bool), st.lists(st.integers(1, 2000), min_size=1, max_size=12)),  # the odd ones by mutation
    some_of({**{k: v for k, v in SAMPLING.items() if k != "chat_template_kwargs"}, "logprobs": st.integers(0, 5)}),
)  # a completion's logprobs: a number of alternatives
response_bodies = st.builds(
    lambda given, extra: {"model": MODEL, "input": given, **extra},
    st.one_of(
        text,
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": text}
            ),
            min_size=1,
            max_size=3,
        ),
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "max_output_tokens": st.integers(1, 10),
            "instructions": text,
            "temperature": SAMPLING["temperature"],
            "top_p": SAMPLING["top_p"],
            "stream": st.booleans(),
        },
    ),
)

tokenize_bodies = st.one_of(
    st.builds(
        lambda prompt, extra: {"model": MODEL, "prompt": prompt, **extra},
        text,
        some_of({"add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}),
    ),
    st.builds(
        lambda messages, extra: {"messages": messages, **extra},
        conversations(),
        some_of(
            {
                "add_generation_prompt": st.booleans(),
                "return_token_strs": st.booleans(),
                "chat_template_kwargs": SAMPLING["chat_template_kwargs"],
                "tools": st.lists(
                    st.builds(
                        lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
                        ident,
                        object_schema,
                    ),
                    max_size=2,
                    unique_by=lambda t: t["function"]["name"],
                ),
            }
        ),
    ),
)
detokenize_bodies = st.fixed_dictionaries(
    {"tokens": st.lists(st.integers(0, 2000), max_size=12)},  # the tokenizer's
    optional={"model": st.just(MODEL)},
)  # own ids (the model's vocabulary is wider)

# (path, body strategy) pairs: each endpoint's own bodies, whole and mutated, and chats that are mostly noise
ENDPOINTS = {
    "/v1/chat/completions": st.one_of(
        chat_bodies(),
        chat_bodies(),
        mutated(chat_bodies()),
        st.fixed_dictionaries({"model": st.just(MODEL), "messages": noise}, optional={k: noise for k in SAMPLING}),
    ),
    "/v1/completions": st.one_of(completion_bodies, completion_bodies, mutated(completion_bodies)),
    "/v1/responses": st.one_of(response_bodies, response_bodies, mutated(response_bodies)),
    "/tokenize": st.one_of(tokenize_bodies, tokenize_bodies, mutated(tokenize_bodies)),
    "/detokenize": st.one_of(detokenize_bodies, detokenize_bodies, mutated(detokenize_bodies)),
}


def capped(body) -> object:
    """The body with a short answer asked for where it asks for none (left out, an answer runs to the context's end)."""
    if isinstance(body, dict) and not {"max_tokens", "max_completion_tokens", "max_output_tokens"} & body.keys():
        return {**body, ("max_output_tokens" if "input" in body else "max_tokens"): 4}
    return body


# ----- stage calls straight to a worker (what a gateway of another version, or anything else, might send) -----


def stage_call_specs(image_token_id: int, image_size: int, tokens_per_image: int):
    """`RequestSpec`s: well-formed ones (images as the gateway sends them, pixels float32 or uint8 with a scaling),
    the same with odd scalings and pixel byte counts, and ones of any values the wire can carry."""
    from epdmesh.v1 import mesh_pb2 as pb

    real = st.floats(allow_nan=True, allow_infinity=True)
    any_sampling = st.builds(
        lambda **kw: pb.SamplingParams(**kw),
        max_tokens=st.integers(0, 40),
        temperature=real,
        top_p=real,
        top_k=st.integers(-5, 100),
        seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        stop=st.lists(st.text(max_size=3), max_size=3),
        stop_token_ids=st.lists(st.integers(-3, 5000), max_size=3),
        logprobs=st.one_of(st.none(), st.integers(0, 40)),
        presence_penalty=real,
        repetition_penalty=st.one_of(st.none(), real),
        logit_bias_token_ids=st.lists(st.integers(-3, 5000), max_size=2),
        logit_bias_values=st.lists(real, max_size=2),
        min_tokens=st.integers(0, 50),
        min_p=real,
        grammar=st.one_of(st.none(), st.sampled_from(['{"type": "object"}', "", "x"])),
    )
    plain_sampling = st.builds(
        lambda n, t, seed: pb.SamplingParams(max_tokens=n, temperature=t, top_p=1.0, seed=seed),
        st.integers(1, 6),
        st.sampled_from([0.0, 0.7]),
        st.one_of(st.none(), st.integers(0, 9)),
    )
    values = 3 * image_size * image_size

    def image(uint8: bool):
        if not uint8:
            return pb.Image(
                pixel_values=bytes(values * 4),
                shape=[3, image_size, image_size],
                dtype="float32",
                num_tokens=tokens_per_image,
            )
        msg = pb.Image(
            pixel_values=bytes(values), shape=[3, image_size, image_size], dtype="uint8", num_tokens=tokens_per_image
        )
        msg.scaling.CopyFrom(pb.PixelScaling(rescale=1 / 255, mean=[0.5] * 3, std=[0.5] * 3))
        return msg

    odd_image = st.builds(
        lambda shape, dtype, size, tokens: pb.Image(
            pixel_values=bytes(size), shape=shape, dtype=dtype, num_tokens=tokens
        ),
        st.lists(st.integers(0, 300), max_size=4),
        st.sampled_from(["float32", "uint8", "float16", "int64", "bool", "complex64", "x", ""]),
        st.sampled_from([0, 7, values * 4]),
        st.integers(0, 600),
    )
    odd_scaling = st.builds(
        lambda rescale, mean, std: pb.PixelScaling(rescale=rescale, mean=mean, std=std),
        st.sampled_from([float("nan"), 1 / 255]),
        st.sampled_from([[0.5], [float("inf")] * 3, [0.5] * 3]),
        st.sampled_from([[0.5] * 3, [0.0] * 3]),
    )
    token = st.integers(5, 2000)

    @st.composite
    def spec(draw):
        images = [image(draw(st.booleans())) for _ in range(draw(st.sampled_from([1, 1, 0, 2])))]
        ids = [1, *draw(st.lists(token, max_size=10)), *[image_token_id] * (tokens_per_image * len(images)), 29, 30]
        msg = pb.RequestSpec(
            request_id=draw(st.text(min_size=1, max_size=8)),
            prompt_token_ids=ids,
            sampling=draw(plain_sampling),
            images=images,
        )
        flaw = draw(
            st.sampled_from(
                [None] * 8 + ["sampling", "token", "placeholders", "image", "scaling", "pixels", "continued", "output"]
            )
        )
        if flaw == "sampling":
            msg.sampling.CopyFrom(draw(any_sampling))
        elif flaw == "token":
            msg.prompt_token_ids[draw(st.integers(0, len(ids) - 1))] = draw(
                st.sampled_from([-3, -1, 4095, 5000, 2**31 - 1])
            )
        elif flaw == "placeholders":
            msg.prompt_token_ids.extend([image_token_id] * draw(st.integers(1, 300)))
        elif flaw == "image":
            msg.images.append(draw(odd_image))
        elif flaw == "scaling" and images:
            msg.images[0].scaling.CopyFrom(draw(odd_scaling))
        elif flaw == "pixels" and images:
            msg.images[-1].pixel_values = msg.images[-1].pixel_values[:-1]
        elif flaw == "continued":
            msg.num_continued_tokens = draw(st.sampled_from([len(ids), 99]))
        elif flaw == "output":
            msg.output_token_ids.extend(draw(st.lists(st.integers(-3, 5000), min_size=1, max_size=3)))
        return msg

    return spec()
