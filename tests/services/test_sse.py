"""The streamed answer's frames: what goes out in each write."""

import asyncio
import json

from common.engine.outputs import RequestOutput
from common.request import RequestStatus
from common.sampling import SamplingParams
from services.gateway.protocol import ChatRequest
from services.gateway.responses import sse


def _outputs(tokens: list[int]):
    async def gen():
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            yield RequestOutput(
                "r",
                [token],
                tokens[: i + 1],
                RequestStatus.FINISHED_LENGTH if last else RequestStatus.DECODING,
                "length" if last else None,
                num_prompt_tokens=5,
            )

    return gen()


def _writes(n: int, tokens: list[int]) -> list[list[dict | str]]:
    chat = ChatRequest(
        "tiny",
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        SamplingParams(max_tokens=len(tokens)),
        stream=True,
        include_usage=True,
        return_token_ids=True,
        n=n,
    )

    async def main():
        return [
            w
            async for w in sse(
                chat,
                "chatcmpl-1",
                "tiny",
                5,
                [_outputs(tokens) for _ in range(n)],
                lambda ids: "".join(chr(97 + i) for i in ids),
            )
        ]

    return [
        [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in w.split("\n\n") if line]
        for w in asyncio.run(main())
    ]


def test_the_role_chunk_goes_out_in_the_same_write_as_the_first_token():
    writes = _writes(1, [0, 1, 2])
    first = writes[0]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "a"}]
    assert first[1]["choices"][0]["token_ids"] == [0]
    assert [w[0]["choices"][0]["delta"].get("content") for w in writes[1:3]] == ["b", "c"]
    assert writes[2][0]["choices"][0]["finish_reason"] == "length"
    assert writes[-2][0]["usage"]["completion_tokens"] == 3 and writes[-1] == ["[DONE]"]
    assert all(len(w) == 1 for w in writes[1:])


def test_with_n_choices_each_role_chunk_goes_out_with_a_token_and_before_its_choices_first():
    writes = _writes(2, [3, 4])
    frames = [(k, c["choices"][0]) for k, w in enumerate(writes) for c in w if isinstance(c, dict) and c["choices"]]
    for index in (0, 1):
        mine = [(k, c["delta"]) for k, c in frames if c["index"] == index]
        assert mine[0][1] == {"role": "assistant", "content": ""}
        assert [d["content"] for _, d in mine[1:]] == ["d", "e"]
        role_write = mine[0][0]
        assert any("role" not in c["delta"] for k, c in frames if k == role_write)  # never a write of its own
