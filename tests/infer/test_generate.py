"""Generation: fixed-size-state decoding matches a full forward, a fixed seed gives fixed text, UTF-8 streams whole."""

import base64
import io

import k3_runs
import pytest
import torch

from k3 import K3Config, K3ForCausalLM, save_pretrained
from k3.ckpt.run import load_checkpoint
from k3.data.tokenizers import ByteTokenizer
from k3.infer.generate import StreamDecoder, generate, generate_ids


def test_greedy_decode_matches_full_recompute(tiny_run):
    model = load_checkpoint(tiny_run)["model"]
    prompt = [256, *b"The cat"]
    new, timing = generate_ids(model, prompt, max_new_tokens=12, temperature=0.0)
    assert len(new) == 12 and timing["prompt_tokens"] == 8
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):  # no state: re-run the whole sequence for every token
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert new == ids[len(prompt):]
    assert not model.training


def test_same_seed_same_text_via_cli(tiny_run):
    argv = ["generate", "--run", str(tiny_run), "--prompt", "The ", "--max-new-tokens", "40", "--top-k", "50",
            "--top-p", "0.9", "--temperature", "1.0"]
    c1, out1, err1 = k3_runs.run_cli(*argv, "--seed", "7")
    c2, out2, _ = k3_runs.run_cli(*argv, "--seed", "7")
    c3, out3, _ = k3_runs.run_cli(*argv, "--seed", "8")
    assert c1 == c2 == c3 == 0
    assert out1 == out2 and out1.startswith("The ") and len(out1) > 10
    assert out3 != out1  # 40 tokens at temperature 1 from an almost untrained model: a collision is ~impossible
    assert "tok/s" in err1 and "prefill 5 tokens" in err1


def test_streamed_text_equals_returned_text(tiny_run):
    ck = load_checkpoint(tiny_run)
    stream = io.StringIO()
    text = generate(ck["model"], ck["tokenizer"], "ab", max_new_tokens=30, seed=3, stream=stream, report=None)
    assert stream.getvalue() == "ab" + text


def test_stream_decoder_holds_back_partial_utf8():
    tok = ByteTokenizer()
    dec = StreamDecoder(tok)
    pieces = [dec.feed(b) for b in "é🦊x".encode()]
    assert pieces == ["", "é", "", "", "", "🦊", "x"]
    assert dec.feed(0xF0) == "" and dec.flush() == "\ufffd"  # an unfinished character at the very end

    class NoBytes:  # a tokenizer that only offers decode(): the re-decoding path
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    dec = StreamDecoder(NoBytes())
    assert "".join(dec.feed(b) for b in "né🦊".encode()) + dec.flush() == "né🦊"


def test_generate_bad_input(tiny_run):
    model = load_checkpoint(tiny_run)["model"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_ids(model, [1], max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate_ids(model, [1], max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_ids(model, [1], max_new_tokens=10**6)
    with pytest.raises(ValueError, match="prompt"):
        generate_ids(model, [], max_new_tokens=1)


def test_generate_from_a_released_folder_with_chat(tmp_path):
    """--model: k3.load_pretrained + K3's tokenizer; --chat renders a user turn (byte-only BPE here)."""
    cfg = K3Config.from_preset("tiny", vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511)
    save_pretrained(K3ForCausalLM(cfg), tmp_path)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n"
                                                     for i in range(256)))
    code, out, err = k3_runs.run_cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "4")
    assert code == 0 and out.startswith("hi") and "prefill 3 tokens" in err, err  # [BOS] h i
    code, out, err = k3_runs.run_cli("generate", "--model", str(tmp_path), "--chat", "--system", "be brief",
                                     "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0")
    assert code == 0, err
    assert int(err.split("prefill ")[1].split()[0]) > 20  # the chat template wraps the two messages
    code, _, err = k3_runs.run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 2 and err.count("\n") == 1 and "tiktoken.model" in err
