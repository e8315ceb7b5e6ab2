"""Absurd inputs are refused before anything is allocated or written: configs whose model cannot fit, numbers that
cannot mean anything, a 100,000-deep JSON, a zip bomb in ``trainer.pt``, a prompt the tokenizer cannot encode.

All commands run in ONE child process so its peak memory can be measured (< 2 GB: nothing was allocated); each
ends in one ``k3: error:`` line and exit 2, and no directory changes.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest

import k3_runs
from k3.ckpt.manifest import write_manifest
from k3.config import K3Config

TINY = K3Config.from_preset("tiny").to_dict()
FAST = k3_runs.FAST


def _zip(records: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive from ``(name, payload, method, uncompressed size, crc)`` records, written field by field (the
    zipfile module cannot store a payload compressed elsewhere)."""
    out, central = bytearray(), bytearray()
    for name, payload, method, usize, crc in records:
        n = name.encode()
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(payload), usize, len(n), 0)
        out += n + payload
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, len(payload), usize,
                               len(n), 0, 0, 0, 0, 0, offset) + n
    cd = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records), len(central), cd, 0)
    return bytes(out)


def _bomb(trainer_pt: Path) -> None:
    """Replace storage record ``data/0`` of a real ``trainer.pt`` by a deflate stream that inflates to ~4 GB of
    zeros (16 MiB blocks flushed so each compresses to the same bytes: the ~4 MB file is built in a second)."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = co.compress(bytes(16 << 20)) + co.flush(zlib.Z_FULL_FLUSH)
    n = 238  # 238 × 16 MiB = 3.99 GB, under zip's 4 GiB field
    with zipfile.ZipFile(trainer_pt) as zf:
        records = []
        for i in zf.infolist():
            if i.filename.endswith("/data/0"):
                records.append((i.filename, block * n + b"\x03\x00", zipfile.ZIP_DEFLATED, n * (16 << 20), 0))
            else:
                records.append((i.filename, zf.read(i), zipfile.ZIP_STORED, i.file_size, i.CRC))
    trainer_pt.write_bytes(_zip(records))


def _run_variant(run: Path, dst: Path, edit) -> Path:
    """A copy of ``run`` whose newest checkpoint is edited and re-manifested (whoever edits can rewrite both)."""
    shutil.copytree(run, dst)
    ck = sorted((dst / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((ck / "checkpoint.json").read_text())
    edit(ck)
    write_manifest(ck, {k: v for k, v in manifest.items() if k not in ("files", "time")})
    return dst


def _config(ck: Path, **fields) -> None:
    (ck / "config.json").write_text(json.dumps({**TINY, **fields}))


CONFIGS = {  # --config FILE.json: the fields → what the refusal must name
    "layers": ({"num_layers": 10**5}, ["num_layers"]),
    "kda_heads": ({"kda_num_heads": 10**6}, ["kda_num_heads=1000000", "--force-memory"]),
    "conv": ({"kda_conv_size": 10**6}, ["kda_conv_size"]),
    "hidden": ({"hidden_size": 10**9}, ["hidden_size=1000000000"]),
    "vocab": ({"vocab_size": 10**12}, ["vocab_size"]),
    "experts": ({"n_experts": 10**9}, ["n_experts=1000000000"]),
    "eps": ({"rms_norm_eps": "abc"}, ["rms_norm_eps"]),
    "mla_layers_int": ({"mla_layers": 42}, ["mla_layers"]),
}
NUMBERS = {  # argv → what the refusal must name
    "batch": (["train", "--batch-size", str(10**12)], ["--batch-size", "2,147,483,647"]),
    "threads": (["train", "--threads", "100000"], ["--threads"]),
    "k3_on_cpu": (["train", "--preset", "k3", "--device", "cpu"], ["routed experts", "n_experts=896", "cpu"]),
    "steps": (["train", "--steps", str(10**12)], ["--steps"]),
    "seq": (["train", "--seq-len", str(10**12)], ["--seq-len"]),
    "batch_mem": (["train", "--batch-size", "100000000", "--seq-len", "16"], ["batch_size=100000000"]),
    "prompt": (["train", "--prompt", "\udcff", "--steps", "2"], ["--prompt", "byte tokenizer"]),
    "deep": (["train", "--config", "deep.json"], ["nests deeper"]),
    "huge_json": (["train", "--config", "huge.json"], ["huge.json", "byte limit"]),
}


@pytest.fixture(scope="module")
def outcome(tiny_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("absurd")
    work = root / "work"
    work.mkdir()
    argv: dict[str, list[str]] = {}
    for name, (fields, _) in CONFIGS.items():
        (work / f"{name}.json").write_text(json.dumps({**TINY, **fields}))
        argv[f"config_{name}"] = ["train", "--config", f"{name}.json", *FAST]
    (work / "deep.json").write_text("{" * 100_000)
    (work / "huge.json").write_text(" " * (17 << 20) + "{}")
    for name, (args, _) in NUMBERS.items():
        argv[name] = args
    argv["max_new"] = ["generate", "--run", str(tiny_run), "--max-new-tokens", str(10**12)]
    argv["eval_batches"] = ["eval", "--run", str(tiny_run), "--batches", str(10**12)]
    runs = root / "runs"
    _run_variant(tiny_run, runs / "experts", lambda ck: _config(ck, n_experts=10**9))
    _run_variant(tiny_run, runs / "layers", lambda ck: _config(ck, num_layers=10**5, mla_layers=[3]))
    _run_variant(tiny_run, runs / "bomb", lambda ck: _bomb(ck / "trainer.pt"))
    argv["run_experts"] = ["generate", "--run", str(runs / "experts")]
    argv["run_layers"] = ["eval", "--run", str(runs / "layers")]
    argv["bomb"] = ["train", "--resume", str(runs / "bomb"), "--steps", "8"]
    before = k3_runs.tree_digest(root)
    results, peak = k3_runs.run_cli_child(*argv.values(), cwd=work)
    return dict(zip(argv, results)), peak, before, root


def _check(result, *needles: str) -> None:
    code, _, err = result
    assert code == 2, (code, err)
    assert err.startswith("k3: error: ") and err.count("\n") == 1 and "Traceback" not in err, repr(err)
    for n in needles:
        assert n in err, (n, err)


def test_absurd_run_configs(outcome):
    results, peak, _, _ = outcome
    for name, (_, needles) in CONFIGS.items():
        _check(results[f"config_{name}"], *needles)
    _check(results["run_experts"], "n_experts=1000000000", "--force-memory")  # a run checkpoint's config.json
    _check(results["run_layers"], "num_layers")
    assert peak < 2 << 30, peak


def test_numbers_that_cannot_mean_anything(outcome):
    results, peak, _, _ = outcome
    for name, (_, needles) in NUMBERS.items():
        _check(results[name], *needles)
    _check(results["max_new"], "--max-new-tokens")
    _check(results["eval_batches"], "--batches")
    assert peak < 2 << 30, peak


def test_zip_bomb_in_trainer_pt_is_refused_before_inflating(outcome):
    results, peak, before, root = outcome
    _check(results["bomb"], "trainer.pt", "compressed", "3,992,977,408", "step-00000004")
    assert (root / "runs" / "bomb" / "checkpoints" / "step-00000004" / "trainer.pt").stat().st_size < 8 << 20
    assert peak < 2 << 30, peak  # it would need ~4 GB inflated
    assert k3_runs.tree_digest(root) == before  # no run directory written, no checkpoint touched
