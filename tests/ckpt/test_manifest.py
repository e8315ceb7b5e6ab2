"""Every byte of a checkpoint verified (``k3.ckpt.manifest``), files over 1 GiB included; ``trainer.pt`` archives
checked before torch inflates them (``k3.ckpt.archive``)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import k3_runs
from k3.ckpt.archive import check_torch_archive, storage_sizes
from k3.ckpt.manifest import CheckpointError, verify_manifest, write_manifest
from k3.ckpt.run import verify_checkpoint
from k3.utils import HashingWriter, sha256_file

FMT = "test-format"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_hashes_every_file_and_refuses_any_change(tmp_path):
    d = tmp_path / "step"
    (d / "sub").mkdir(parents=True)
    (d / "a.json").write_text('{"x": 1}\n')
    (d / "sub" / "b.bin").write_bytes(bytes(range(256)) * 40)
    with open(d / "t.pt", "wb") as f:  # hashed while written: no second read
        w = HashingWriter(f)
        torch.save({"w": torch.randn(300), "step": 3}, w)
    m = write_manifest(d, {"format": FMT, "step": 3}, {"t.pt": w.hexdigest()})
    assert set(m["files"]) == {"a.json", "sub/b.bin", "t.pt"}
    for rel, e in m["files"].items():
        assert e == {"size": (d / rel).stat().st_size, "sha256": _sha(d / rel)}
    assert verify_manifest(d, FMT)["step"] == 3
    with pytest.raises(CheckpointError, match="not a other manifest"):
        verify_manifest(d, "other")

    blob = bytearray((d / "sub" / "b.bin").read_bytes())
    blob[5000] ^= 0x08
    (d / "sub" / "b.bin").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"sub/b\.bin does not match its sha256"):
        verify_manifest(d, FMT)
    (d / "sub" / "b.bin").write_bytes(bytes(blob[:100]))
    with pytest.raises(CheckpointError, match=r"sub/b\.bin has 100 bytes, the manifest says 10240"):
        verify_manifest(d, FMT)
    (d / "sub" / "b.bin").unlink()
    with pytest.raises(CheckpointError, match=r"sub/b\.bin is missing"):
        verify_manifest(d, FMT)
    (d / "link").symlink_to(d / "a.json")
    with pytest.raises(CheckpointError, match="link is a symlink"):
        write_manifest(d, {"format": FMT})


def test_over_1_gib_file_hashed_and_a_flipped_bit_refused(tiny_run, tmp_path):
    """A >1 GiB file (sparse, so the test stays fast) gets a real sha256; one flipped bit is refused in one line."""
    run = k3_runs.copy_run(tiny_run, tmp_path / "r")
    ck = run / "checkpoints" / "step-00000004"
    big = ck / "model.safetensors"
    with open(big, "r+b") as f:
        f.truncate((1 << 30) + (100 << 20))
    fields = {k: v for k, v in json.loads((ck / "checkpoint.json").read_text()).items() if k not in ("files", "time")}
    entry = write_manifest(ck, fields)["files"]["model.safetensors"]
    assert entry["size"] > 1 << 30 and len(entry["sha256"]) == 64
    verify_checkpoint(ck)  # unchanged: verified
    with open(big, "r+b") as f:  # one exponent-like bit past the first GiB
        f.seek((1 << 30) + 12_345)
        f.write(b"\x40")
    before = k3_runs.tree_digest(run)
    (code, _, err), = k3_runs.run_cli_child(["generate", "--run", str(run)])[0]
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "model.safetensors does not match its sha256" in err and "step-00000004" in err
    assert k3_runs.tree_digest(run) == before


# --- trainer.pt archives ------------------------------------------------------------------------------------------
def _saved(obj, path: Path, **kw) -> Path:
    torch.save(obj, path, **kw)
    return path


def _rewrite(src: Path, dst: Path, change) -> Path:
    """Copy a torch.save archive record by record, ``change(name, data) -> (data, compress_type)``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for i in zin.infolist():
            data, kind = change(i.filename, zin.read(i))
            zout.writestr(zipfile.ZipInfo(i.filename), data, compress_type=kind)
    return dst


def test_real_archives_pass_and_their_storages_are_read(tmp_path):
    state = {"step": 7, "m": [torch.randn(5, 3), torch.zeros(4, dtype=torch.bfloat16)],
             "b": torch.ones(2, dtype=torch.bool)}
    for proto in (2, 4):  # GLOBAL + BINPUT (torch's default) and STACK_GLOBAL + MEMOIZE
        p = _saved(state, tmp_path / f"p{proto}.pt", pickle_protocol=proto)
        check_torch_archive(p, 1 << 30)
        with zipfile.ZipFile(p) as zf:
            pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
            assert sorted(storage_sizes(zf.read(pkl)).values()) == [2, 8, 60]
    assert torch.load(tmp_path / "p2.pt", weights_only=True)["step"] == 7
    with pytest.raises(ValueError, match="needs 70 bytes of memory, more than the 10 available"):
        check_torch_archive(tmp_path / "p2.pt", 10)


def test_compressed_or_oversized_records_refused_before_inflating(tmp_path):
    src = _saved({"x": torch.zeros(70_000)}, tmp_path / "src.pt")
    deflated = _rewrite(src, tmp_path / "deflated.pt",
                        lambda n, d: (d, zipfile.ZIP_DEFLATED if n.endswith("data/0") else zipfile.ZIP_STORED))
    with pytest.raises(ValueError, match=r"record 'src/data/0' is compressed \(\d+ bytes claiming 280,000\)"):
        check_torch_archive(deflated, None)
    # the pickle declares 2**28 floats (1 GiB) for a record of 280,000 bytes
    numel = b"J" + struct.pack("<i", 70_000)
    lying = _rewrite(src, tmp_path / "lying.pt", lambda n, d: (
        d.replace(numel, b"J" + struct.pack("<i", 1 << 28)) if n.endswith("data.pkl") else d, zipfile.ZIP_STORED))
    with pytest.raises(ValueError, match="storage '0' needs 1,073,741,824 bytes but its record holds 280,000"):
        check_torch_archive(lying, None)
    with pytest.raises(ValueError, match="not a torch.save zip archive"):
        check_torch_archive(_saved_bytes(tmp_path / "junk.pt", b"PK\x03\x04 nothing"), None)


def _saved_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_hashing_writer_matches_file_hash(tmp_path):
    buf = io.BytesIO()
    w = HashingWriter(buf)
    torch.save({"a": torch.arange(1000)}, w)
    (tmp_path / "f").write_bytes(buf.getvalue())
    assert w.hexdigest() == sha256_file(tmp_path / "f") == _sha(tmp_path / "f") and w.size == len(buf.getvalue())
