"""Tokenizers round-trip: byte-level, a tiktoken BPE file written here, a Hugging Face tokenizer.json built here;
batched encoding equals one document at a time."""

import base64
import json

import pytest

from k3.data import files
from k3.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
    read_tiktoken_ranks,
    tokenizer_from_dict,
)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "naïve café — 東京 🦊\n\ttabs  and  spaces",
         "<|eos|> stays text", ""]


def test_byte_tokenizer_round_trip_and_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (260, 256, 257, 259)
    assert tok.stop_ids == {257}
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode([256, *tok.encode("hi"), 257, 259]) == "hi"  # specials are not text
    assert isinstance(tokenizer_from_dict(tok.to_dict()), ByteTokenizer)
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")


def _write_tiktoken(path, merges=(b"th", b"he", b"the", b" t", b" the", b"in", b"ing")):
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return len(tokens)


def test_tiktoken_file_round_trip(tmp_path):
    pytest.importorskip("tiktoken")
    n = _write_tiktoken(tmp_path / "tiktoken.model")
    assert len(read_tiktoken_ranks(tmp_path / "tiktoken.model")) == n
    tok = load_tokenizer(tmp_path / "tiktoken.model")
    assert isinstance(tok, TiktokenTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (n, n + 1, n + 2, n + 3)
    assert tok.encode("the") == [258] and tok.encode(" the") == [260]  # merges are used
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.bos_id, *tok.encode("x"), tok.eos_id]) == "x"
    # a run directory keeps a copy of the file; the spec rebuilds the same tokenizer from it
    run = tmp_path / "run"
    run.mkdir()
    spec = tok.save(run)
    (tmp_path / "tiktoken.model").unlink()
    again = tokenizer_from_dict(json.loads(json.dumps(spec)), root=run)
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and again.eos_id == tok.eos_id


def test_tiktoken_bad_files(tmp_path):
    pytest.importorskip("tiktoken")
    bad = tmp_path / "bad.model"
    bad.write_text("not base64! 0\n")
    with pytest.raises(ValueError, match=r"bad.model:1: expected '<base64 token> <rank>'"):
        read_tiktoken_ranks(bad)
    bad.write_text(f"{base64.b64encode(b'a').decode()} 0\n{base64.b64encode(b'b').decode()} 5\n")
    with pytest.raises(ValueError, match="gaps"):
        read_tiktoken_ranks(bad)


def _build_hf(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 20 + ["the theory of the thing"] * 20, trainer)
    tok.save(str(path))


def test_hf_tokenizer_json_round_trip(tmp_path):
    pytest.importorskip("tokenizers")
    _build_hf(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)  # a directory holding tokenizer.json
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)  # found by their usual names
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the theory of the thing")) < len("the theory of the thing")  # merges learned
    run = tmp_path / "run"
    run.mkdir()
    again = tokenizer_from_dict(tok.save(run), root=run)
    assert again.encode(TEXTS[0]) == tok.encode(TEXTS[0]) and again.vocab_size == tok.vocab_size
    # a changed file is refused, not silently used
    (run / "tokenizer_files" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="sha256"):
        tokenizer_from_dict(tok.save(tmp_path / "elsewhere") | {"path": str(run / "tokenizer_files/tokenizer.json")})


def test_load_tokenizer_bad_spec(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="neither tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="kind"):
        tokenizer_from_dict({"kind": "sentencepiece"})


@pytest.mark.parametrize("kind", ["byte", "tiktoken", "hf"])
def test_batched_tokenization_equals_one_document_at_a_time(kind, tmp_path, monkeypatch):
    """``k3 tokenize`` / ``--data`` encode documents in batches across cores; the shard must not change."""
    if kind == "byte":
        tok = ByteTokenizer()
    elif kind == "tiktoken":
        pytest.importorskip("tiktoken")
        _write_tiktoken(tmp_path / "tiktoken.model")
        tok = load_tokenizer(tmp_path / "tiktoken.model")
    else:
        pytest.importorskip("tokenizers")
        _build_hf(tmp_path / "tokenizer.json")
        tok = load_tokenizer(tmp_path / "tokenizer.json")
    docs = [TEXTS[i % len(TEXTS)] * (1 + i % 3) + f" doc {i}" for i in range(23)] + ["", "  \n"]
    monkeypatch.setattr(files, "_BATCH_DOCS", 4)  # several batches, the last one partial
    one_by_one = [[*([tok.bos_id] if tok.bos_id is not None else []), *tok.encode(d),
                   *([tok.eos_id] if tok.eos_id is not None else [])] for d in docs if d.strip()]
    flat = [i for ids in one_by_one for i in ids]
    assert files.tokenize_documents(iter(docs), tok).tolist() == flat
    assert tok.encode_batch(docs) == [tok.encode(d) for d in docs]
    five = sum(len(ids) for ids in one_by_one[:5])
    assert files.tokenize_documents(docs, tok, max_tokens=five - 3).tolist() == flat[:five]  # ends after doc 5
    with pytest.raises(ValueError, match="str"):
        tok.encode_batch(["ok", b"bytes"])
