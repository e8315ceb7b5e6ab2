"""The released layout (MXFP4 experts, several safetensors shards) loaded expert-sharded on 2 and 4 gloo ranks:
the one-process logits (fp32 ≤ 1e-5) and greedy decode, each rank reading exactly its own experts' tensors (every
``get_tensor`` is recorded), holding 1/R of the expert bytes; and ``k3 generate --model`` under torchrun's
environment printing, on rank 0 only, the one-process text."""

import base64
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (DTensor imports it on first use: once here, not in every forked rank)
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401

import k3_runs
from k3.ckpt.released import load_pretrained, save_pretrained
from k3.config import K3Config
from k3.distributed.release import load_expert_sharded
from k3.infer.generate import generate_ids
from k3.model import K3ForCausalLM

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)

EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w[123]\.weight_(packed|scale)$")
N_EXPERTS, MOE_LAYERS = 8, 3  # preset tiny: layers 1–3 are MoE


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """preset tiny (fp32 dense part) in the released layout: MXFP4 experts, shards of ≤ 64 KB, a byte tokenizer."""
    folder = tmp_path_factory.mktemp("release") / "tiny"
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny", vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511)
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight") or ".experts." in name:
                p.normal_(0.0, 0.3)
    save_pretrained(model, folder, quantize=True, max_shard_bytes=64 << 10)
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n"
                                                   for i in range(256)))
    assert len(list(folder.glob("model-*.safetensors"))) > 3
    return folder


def _record_reads(reads: dict[str, int]) -> None:
    """Wrap ``safe_open`` (as the loader names it) so that every tensor read lands in ``reads`` (name → bytes)."""
    import k3.ckpt.released as released

    real = released.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            reads[name] = reads.get(name, 0) + t.numel() * t.element_size()
            return t

    released.safe_open = Recording


def _sharded(rank: int, world: int, folder: Path, ids: torch.Tensor, want: torch.Tensor, greedy: list[int],
             all_names: set[str]) -> None:
    reads: dict[str, int] = {}
    _record_reads(reads)
    model = load_expert_sharded(folder)
    M = N_EXPERTS // world
    mine = set(range(rank * M, (rank + 1) * M))
    got_experts = {int(m.group(1)) for n in reads if (m := EXPERT.search(n))}
    assert got_experts == mine  # exactly its own experts' tensors …
    assert sum(1 for n in reads if EXPERT.search(n)) == MOE_LAYERS * M * 3 * 2  # … every one of them, once
    assert {n for n in all_names if not EXPERT.search(n)} <= set(reads)  # and the whole dense part
    expert_bytes = sum(b for n, b in reads.items() if EXPERT.search(n))
    held = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n)
    assert held == expert_bytes
    total = torch.tensor([expert_bytes])
    dist.all_reduce(total)
    assert int(total) == world * expert_bytes  # 1/R of the experts each, nothing twice
    with torch.no_grad():
        assert rel(model(ids).logits, want) <= 1e-5
    new, _ = generate_ids(model, ids[0].tolist(), max_new_tokens=6, temperature=0.0)  # decode: expert parallel
    assert new == greedy


def _cli(rank: int, world: int, folder: Path, out_dir: Path) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    code, out, err = k3_runs.run_cli("generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "5",
                                     "--temperature", "0", "--device", "cpu")
    (out_dir / f"rank{rank}.txt").write_text(f"{code}\n{out}\x00{err}")


def test_expert_sharded_load_equals_one_process(release: Path, tmp_path: Path) -> None:
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = load_pretrained(release, verbose=False)
    with torch.no_grad():
        want = ref(ids).logits
    greedy, _ = generate_ids(ref, ids[0].tolist(), max_new_tokens=6, temperature=0.0)
    from safetensors import safe_open

    names = set()
    for shard in release.glob("model-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names |= {n for n in f.keys()}
    for world in (2, 4):
        _gloo.run_ranks(_sharded, world, release, ids, want, greedy, names)

    code, out_one, err = k3_runs.run_cli("generate", "--model", str(release), "--prompt", "hi", "--max-new-tokens",
                                         "5", "--temperature", "0", "--device", "cpu")
    assert code == 0, err
    _gloo.run_ranks(_cli, 2, release, tmp_path)
    results = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    assert [int(c) for c, _ in results] == [0, 0], results
    (out0, err0), (out1, err1) = (r.split("\x00") for _, r in results)
    assert out0 == out_one and out0.startswith("hi") and "prefill 3 tokens" in err0  # rank 0 prints …
    assert out1 == err1 == ""  # … rank 1 decodes too, silently
    _gloo.run_ranks(_cli, 3, release, tmp_path)  # 3 ranks cannot split 8 experts: one line, exit 2, every rank
    for r in range(3):
        code, rest = (tmp_path / f"rank{r}.txt").read_text().split("\n", 1)
        err = rest.split("\x00")[1]
        assert code == "2" and err.count("\n") == 1 and "must divide the checkpoint's 8 experts" in err, err
