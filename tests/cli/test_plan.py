"""`k3 plan`: the parameter count of its table equals the model's own ``num_parameters()`` (built on meta), every
layout it reports as fitting fits the stated GPU memory, the serving table, and bad flags (one line, exit 2)."""

import re

import pytest
import torch

import k3_runs
from k3.config import K3Config
from k3.distributed.plan import Hardware, Layout, model_stats, train_estimate
from k3.model import K3ForCausalLM


def _meta_parameters(preset: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    monkeypatch.setattr(K3ForCausalLM, "reset_parameters", lambda self: None)  # counting only: no init on meta
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.from_preset(preset))
    return model.num_parameters(), model.num_parameters(active=True)


def _rows(out: str) -> list[list[str]]:
    return [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith(("| dp_rep", "| part", "| GPUs"))]


def test_k3_on_2048_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = k3_runs.run_cli("plan", "--preset", "k3", "--gpus", "2048")
    assert code == 0, err
    total = int(re.search(r"\| \*\*total\*\* \| \*\*([\d,]+)\*\* \|", out).group(1).replace(",", ""))
    active = int(re.search(r"\| active per token \| ([\d,]+) \|", out).group(1).replace(",", ""))
    assert (total, active) == _meta_parameters("k3", monkeypatch)
    layouts = [r for r in _rows(out) if len(r) == 15]
    assert layouts and all(r[9] == "yes" for r in layouts)  # the fastest fitting layouts are listed
    for r in layouts:
        assert float(r[8].replace(",", "")) * 1e9 <= 141e9
        assert int(r[0]) * int(r[1]) * int(r[2]) == 2048 and 896 % int(r[3]) == 0
    assert "assumptions:" in out and "torchrun --nnodes 256 --nproc_per_node 8 -m k3 train" in out


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_stats_follow_the_modules(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ms = model_stats(K3Config.from_preset(preset))
    assert (ms.total, ms.active) == _meta_parameters(preset, monkeypatch)


def test_estimates_scale_as_stated() -> None:
    ms = model_stats(K3Config.from_preset("small"))
    hw = Hardware()
    one = train_estimate(ms, hw, Layout(dp_shard=8), 4096, 64)
    ep = train_estimate(ms, hw, Layout(dp_shard=8, ep=8), 4096, 64)
    cp = train_estimate(ms, hw, Layout(dp_shard=4, cp=2), 4096, 64)
    # static bytes depend on dp_shard·cp only; EP adds all-to-all traffic; CP halves the tokens per GPU
    assert one.memory["weights"] == ep.memory["weights"] == cp.memory["weights"]
    assert one.comm["EP all-to-all"] == 0 < ep.comm["EP all-to-all"]
    assert cp.memory["logits"] * 2 == one.memory["logits"] and cp.comm["CP all-gather"] > 0
    assert one.flops == ep.flops == cp.flops and one.model_flops < one.flops  # recompute costs a forward


def test_serve_table() -> None:
    code, out, err = k3_runs.run_cli("plan", "--gpus", "16", "--serve", "--gpu-memory", "288GB")
    assert code == 0, err
    row = next(r for r in _rows(out) if len(r) == 13)
    assert row[0] == "16" and row[6] == "yes" and float(row[2]) == pytest.approx(2_722_740_830_208 * (0.5 + 1 / 32)
                                                                                   / 16 / 1e9, rel=1e-3)
    assert "the fewest GPUs that fit" in out
    code, out, _ = k3_runs.run_cli("plan", "--gpus", "64", "--serve")  # 141 GB: only from 224 GPUs on
    assert code == 0 and "the fewest GPUs that fit batch 1 at 131,072 tokens: 224" in out
    code, out, _ = k3_runs.run_cli("plan", "--gpus", "64", "--serve", "--gpu-memory", "120GB")
    assert code == 0 and "no GPU count fits" in out  # the replicated bf16 dense part alone is 113.5 GB


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "8", "--gpu-memory", "lots"], "--gpu-memory"),
    (["--gpus", "8", "--ep", "3"], "--ep 3 must divide"),
    (["--gpus", "8", "--cp", "3"], "--cp 3 must divide"),
    (["--gpus", "8", "--cp", "2", "--seq-len", "4097"], "--cp 2 must divide --seq-len"),
    (["--gpus", "8", "--dp-shard", "3"], "--dp-shard 3"),
    (["--gpus", "8", "--dp-shard", "4", "--cp", "2", "--ep", "16"], "--ep 16"),
    (["--gpus", "8", "--global-batch", "3", "--dp-shard", "8"], "--global-batch 3"),
    (["--gpus", "8", "--serve", "--cp", "2"], "--serve"),
    (["--gpus", "8", "--preset", "nope"], "preset"),
])
def test_bad_flags_one_line(argv: list[str], message: str) -> None:
    code, out, err = k3_runs.run_cli("plan", *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("k3: error:") and message in err, (code, err)
