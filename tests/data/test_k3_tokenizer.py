"""K3 tokenizer from a real ``tiktoken.model`` file written here: BPE + specials ids, K3's pre-tokenizer regex
(incl. the ``&&`` "letters but not Han" classes inside tiktoken's engine), round trips, and the XTML chat prompt
(user text never turns into control tokens)."""

from __future__ import annotations

import base64
import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("tiktoken")

from k3.data.k3_tokenizer import K3_PAT_STR, load_k3_tokenizer  # noqa: E402

NIHAO = "你".encode()
MERGES = [b"He", b"ll", b"Hell", b"Hello", b" w", b"or", b"ld", b" wor", b" world", b"\xe4\xbd", NIHAO,
          b"a" + NIHAO,  # only reachable if "a你" were one pre-token: K3's regex keeps Han out of words
          b"<|", b"|>", b"en", b"op", b"open", b"'s", b" 1", b"12", b"123", b"\n\n", b"  "]


def write_model(folder: Path, tokens: list[bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(tokens)]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = write_model(tmp_path_factory.mktemp("tok"), [bytes([i]) for i in range(256)] + MERGES)
    return load_k3_tokenizer(folder)


def test_special_ids_follow_the_bpe_ranks(tok):
    n = 256 + len(MERGES)
    assert tok.vocab_size == n + 256
    assert (tok.bos_id, tok.doc_eos_id, tok.eos_id) == (n, n + 1, n + 2)
    assert [tok.special_id(s) for s in ("<|open|>", "<|close|>", "<|sep|>")] == [n + 3, n + 4, n + 5]
    assert tok.special_id("[PAD]") == n + 255 and tok.special_id("<|media_pad|>") == n + 21
    assert tok.special_id(f"<|reserved_token_{n + 100}|>") == n + 100
    assert tok.stop_ids == {tok.eos_id, tok.doc_eos_id}  # <|end_of_msg|> ends a turn, [EOS] a document
    assert tok.decode([n + 2]) == "<|end_of_msg|>"
    assert tok.decode_bytes(tok.encode("Hi 你") + [n + 2]) == "Hi 你".encode()  # specials dropped


def test_full_size_vocabulary_gives_the_released_ids(tmp_path):
    """163,584 ranks, as in the release: the specials land on 163584… exactly."""
    base = [bytes([i]) for i in range(256)]
    pairs = [bytes(p) for p in itertools.product(range(256), repeat=2)]
    triples = (bytes(t) for t in itertools.product(range(1, 256), repeat=3))
    tokens = base + pairs + list(itertools.islice(triples, 163_584 - len(base) - len(pairs)))
    t = load_k3_tokenizer(write_model(tmp_path, tokens) / "tiktoken.model")
    assert t.vocab_size == 163_840
    assert (t.bos_id, t.doc_eos_id, t.eos_id, t.pad_id) == (163_584, 163_585, 163_586, 163_839)
    assert t.special_id("<|open|>") == 163_587 and t.special_id("<osagent_mode>") == 163_649
    text = "Hello world, 你好世界! ümlaut 12345\n\n  tabs\t"
    assert t.decode(t.encode(text)) == text


@pytest.mark.parametrize("text", [
    "Hello world", "", " ", "a你", "Ça va? It's 12345 o'clock.\n\n\tdone  ", "你好世界 and 世界",
    "emoji 🙂🙂 mixed ÀÉÎ lower àéî", "<|open|> is text here", "x" * 3000 + " " * 30_000 + "y",
], ids=lambda t: repr(t[:12]))
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_base for i in ids)  # never a special id from plain text
    assert tok.decode(ids) == text


def test_merges_and_han_intersection(tok):
    r = {t: 256 + i for i, t in enumerate(MERGES)}
    assert tok.encode("Hello world") == [r[b"Hello"], r[b" world"]]
    # 'a你': the word branches take letters that are NOT Han ([...&&[^\p{Han}]]), so 'a' and '你' are separate
    # pre-tokens and the merged 'a你' token can never appear; a regex engine that ignored && would produce it.
    assert tok.encode("a你") == [ord("a"), r[NIHAO]]
    assert tok.encode("你") == [r[NIHAO]]
    assert tok.encode("1234") == [r[b"123"], ord("4")]  # numbers split into ≤ 3 digits


def _bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = min(((ranks.get(parts[i] + parts[i + 1], 1 << 60), i) for i in range(len(parts) - 1)))
        if best[0] == 1 << 60:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def test_pre_tokenizer_agrees_with_the_regex_module(tok):
    regex = pytest.importorskip("regex")
    ranks = {bytes([i]): i for i in range(256)} | {t: 256 + i for i, t in enumerate(MERGES)}
    pat = regex.compile(K3_PAT_STR, flags=regex.V1)  # V1: && is set intersection there too
    for text in ["Hello world's 12345", "a你b 你好 ÀBCdef GHI jkl", "x  \n\n y\r\n", " <|open|>!! 'S 'LL",
                 "MiXeD CaSe wORDS", "tab\tsep  end   "]:
        want = [i for piece in pat.findall(text) for i in _bpe(piece.encode(), ranks)]
        assert tok.encode(text) == want, text


def test_specials_only_when_allowed(tok):
    assert tok.encode("<|open|>", allow_special=True) == [tok.special_id("<|open|>")]
    assert tok.special_id("<|open|>") not in tok.encode("<|open|>")


def _n_special(tok, ids):
    return sum(i >= tok.n_base for i in ids)


def test_chat_prompt_instruct(tok):
    ids = tok.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|open|>"}])
    assert tok.decode(ids) == (
        '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Hi <|open|><|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    # the user's literal "<|open|>" stays BPE: only the 5 + 5 + 4 structural markers are special ids
    assert _n_special(tok, ids) == 14
    open_id = tok.special_id("<|open|>")
    assert ids.count(open_id) == 4 and ids[-1] == tok.special_id("<|sep|>")
    # each message ends with the stop token
    assert ids.count(tok.eos_id) == 2


def test_chat_prompt_thinking_history_and_attributes(tok):
    msgs = [{"role": "user", "content": "q1", "name": 'a"b&c'},
            {"role": "assistant", "content": "a1", "reasoning_content": "hmm"},
            {"role": "tool", "tool": "calc", "content": "42"},
            {"role": "user", "content": "q2"}]
    text = tok.decode(tok.chat_prompt(msgs, thinking=True))
    assert 'role="user" name="a&quot;b&amp;c"<|sep|>q1' in text
    assert ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>hmm<|close|>think<|sep|>'
            '<|open|>response<|sep|>a1<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>') in text
    assert '<|open|>message role="tool" tool="calc" index="1"<|sep|>42' in text
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    instruct = tok.decode(tok.chat_prompt(msgs, thinking=False))
    assert "think" not in instruct and instruct.endswith("<|open|>response<|sep|>")


def test_bad_inputs(tok, tmp_path):
    with pytest.raises(ValueError, match="role"):
        tok.chat_prompt([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="list"):
        tok.chat_prompt("hello")
    with pytest.raises(ValueError, match="tool"):
        tok.chat_prompt([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="ids must be in"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="text must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="no tiktoken.model"):
        load_k3_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("!!notbase64 0\n")
    with pytest.raises(ValueError, match=":1: expected"):
        load_k3_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nQg== 2\n")
    with pytest.raises(ValueError, match="no gaps"):
        load_k3_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nQg== 1\n")
    with pytest.raises(ValueError, match="single-byte"):
        load_k3_tokenizer(tmp_path)


def test_tokenizer_config_names_win(tmp_path):
    folder = write_model(tmp_path, [bytes([i]) for i in range(256)])
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"256": {"content": "[BOS]"}, "264": {"content": "<|custom|>"}}}))
    t = load_k3_tokenizer(folder)
    assert t.special_id("<|custom|>") == 264 and t.bos_id == 256
