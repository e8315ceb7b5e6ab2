"""Chat prompts: K3's own renderer equals a Jinja template written in the released model's XTML format (a BPE with
real merges, multi-turn), template discovery in a checkpoint folder, the plain format of byte runs, message checks."""

import base64
import json

import pytest

from k3.data.k3_tokenizer import load_k3_tokenizer
from k3.data.tokenizers import ByteTokenizer
from k3.serve.chat import PLAIN_STOPS, chat_format, check_messages, find_chat_template

XTML_TEMPLATE = """
{%- for m in messages -%}
<|open|>message role="{{ m.role }}"{% if m.name %} name="{{ m.name }}"{% endif %}<|sep|>
{%- if m.role == 'assistant' -%}
<|open|>response<|sep|>{{ m.content }}<|close|>response<|sep|>
{%- else -%}
{{ m.content }}
{%- endif -%}
<|close|>message<|sep|><|end_of_msg|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|open|>message role="assistant"<|sep|><|open|>response<|sep|>
{%- endif -%}
"""

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hello there, assistant!"},
    {"role": "assistant", "content": "Hello. What do you need?"},
    {"role": "user", "name": "ana", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "age."}]},
]


@pytest.fixture
def k3_folder(tmp_path):
    """A K3 tokenizer folder: the 256 bytes plus merges, so BPE boundaries matter."""
    merges = [b"me", b"ss", b"ag", b"age", b"ro", b"le", b"role", b" role", b"us", b"er", b"user", b"He", b"ll",
              b"llo", b"Hello", b"re", b"sp", b"on", b"se", b"spon", b"sponse", b"response", b"as", b"ssage",
              b"message", b"ant", b"ist", b"assist", b"assistant"]
    ranks = [bytes([i]) for i in range(256)] + merges
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return tmp_path


def test_k3_renderer_equals_the_jinja_template_in_the_released_format(k3_folder):
    tok = load_k3_tokenizer(k3_folder)
    ours = chat_format(tok, k3_folder)
    assert ours.kind == "k3"
    (k3_folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": XTML_TEMPLATE}))
    jinja = chat_format(tok, k3_folder)
    assert jinja.kind == "jinja"
    for n in (1, 2, 3, 4):
        a, b = ours.render(CONVERSATION[:n]), jinja.render(CONVERSATION[:n])
        assert a == b, (tok.decode(a), tok.decode(b))
    ids = ours.render(CONVERSATION)
    assert tok.special_id("<|end_of_msg|>") in ids and len(ids) < len(tok.decode(ids))  # merges were used


def test_template_discovery(tmp_path):
    assert find_chat_template(tmp_path) is None and find_chat_template(None) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert find_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert find_chat_template(tmp_path) == "J"  # the standalone file wins
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        find_chat_template(tmp_path)


def test_plain_format_for_byte_runs_and_jinja_without_special_flag(tmp_path):
    tok = ByteTokenizer()
    fmt = chat_format(tok, tmp_path)
    assert fmt.kind == "plain" and fmt.stops == PLAIN_STOPS
    ids = fmt.render(CONVERSATION[:3])
    assert ids[0] == tok.bos_id
    assert tok.decode(ids[1:]) == ("System: You are a terse assistant.\n\nUser: Hello there, assistant!\n\n"
                                   "Assistant: Hello. What do you need?\n\nAssistant:")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                                  "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    rendered = tok.decode(chat_format(tok, tmp_path).render(CONVERSATION[1:2]))
    assert rendered == "[user]Hello there, assistant![assistant]"


def test_message_checks():
    for bad in ([], "hi", [{"role": "robot", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 3}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], ["user: hi"]):
        with pytest.raises(ValueError, match="messages"):
            check_messages(bad)
    assert check_messages([{"role": "assistant", "content": None}]) == [{"role": "assistant", "content": ""}]
