"""The API's server-sent event framing: a stream's text chunks, cut from a per-request template, are byte for byte
the chunk objects' JSON (any text: quotes, backslashes, newlines, NUL, non-ASCII, the template's own marker)."""

import json

import pytest

from k3.serve.api import _Kind, _sse


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("name", ["tiny", 'a "quoted" name', "\x00k3-text\x00"])
def test_text_chunks_from_the_template_equal_the_chunk_json(chat, name):
    kind = _Kind(chat, name)
    text_sse = kind.text_sse()
    for text in ["hi", "", 'é"\\\n\x00 ü 😀', "\x00k3-text\x00", "data: [DONE]\n\n"]:
        got = text_sse(text)
        assert got == _sse(kind.chunk(text))
        body = json.loads(got.removeprefix("data: ").removesuffix("\n\n"))
        assert body["model"] == name
        assert (body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]) == text
