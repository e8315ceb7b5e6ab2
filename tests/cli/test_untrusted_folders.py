"""Untrusted folders: every path a checkpoint, index, manifest or tokenizer spec names stays inside its folder, and
absurd released configs are refused before anything is allocated.

All commands run in ONE child process (real files, the real CLI) so its peak memory can be measured: each case ends
in one ``k3: error:`` line and exit 2, the folders are unchanged, nothing from outside is echoed, and the child
never exceeds 2 GB.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import k3_runs
from k3.ckpt.manifest import write_manifest
from k3.ckpt.released import save_pretrained
from k3.config import K3Config
from k3.model import K3ForCausalLM

PASSWD = "/etc/passwd"
SECRET = "root:"  # the first field of /etc/passwd's first line: must never reach stderr


def _released(folder: Path) -> Path:
    """A miniature released folder written by k3's own writer: tiny model (vocab 512), byte-level tiktoken.model."""
    torch.manual_seed(0)
    config = K3Config.from_preset("tiny", vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511)
    save_pretrained(K3ForCausalLM(config), folder, quantize=False)
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n"
                                                   for i in range(256)))
    return folder


def _variant(base: Path, name: str, edit) -> Path:
    folder = base.parent / name
    shutil.copytree(base, folder, symlinks=True)
    edit(folder)
    return folder


def _edit_text_config(**fields):
    def edit(folder: Path) -> None:
        raw = json.loads((folder / "config.json").read_text())
        for key, value in fields.items():
            target = raw["text_config"]
            if key.startswith("lac."):
                target, key = target["linear_attn_config"], key[4:]
            target[key] = value
        (folder / "config.json").write_text(json.dumps(raw))
    return edit


def _edit_index(value_of):
    def edit(folder: Path) -> None:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        new = {v: value_of(folder, v) for v in set(index["weight_map"].values())}  # each shard moved once
        index["weight_map"] = {k: new[v] for k, v in index["weight_map"].items()}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


def _outside_shard(folder: Path, shard: str) -> str:
    """Move the shard out of the folder (a valid file: before the fix, it loaded from there)."""
    outside = folder.parent / f"outside-{folder.name}"
    outside.mkdir()
    os.replace(folder / shard, outside / shard)
    return str(outside / shard)


def _symlink_shard(folder: Path) -> None:
    shard = next(folder.glob("model-*.safetensors"))
    target = Path(_outside_shard(folder, shard.name))
    shard.symlink_to(target)


def _symlink(name: str, target: str):
    def edit(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).symlink_to(target)
    return edit


def _check_refused(result, *needles: str) -> None:
    code, out, err = result
    assert code == 2, (code, err)
    assert err.startswith("k3: error: ") and err.count("\n") == 1 and "Traceback" not in err, repr(err)
    assert SECRET not in err, err
    for n in needles:
        assert n in err, (n, err)


def _checkpoint_variant(run: Path, dst: Path, edit) -> Path:
    """A copy of ``run`` whose newest checkpoint is edited, then re-manifested (an attacker controls both)."""
    shutil.copytree(run, dst)
    ck = sorted((dst / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((ck / "checkpoint.json").read_text())
    edit(ck)
    write_manifest(ck, {k: v for k, v in manifest.items() if k not in ("files", "time")})
    return ck


def _spec(path: str):
    def edit(ck: Path) -> None:
        (ck / "tokenizer_spec.json").write_text(json.dumps({"kind": "tiktoken", "path": path}))
    return edit


def _manifest_entry(rel: str, link: str | None = None):
    """Runs after the re-manifest (see below): adds an entry naming ``rel`` (and a symlink ``link`` → outside)."""
    def edit(ck: Path) -> None:
        if link is not None:
            (ck / link).symlink_to(PASSWD)
        m = json.loads((ck / "checkpoint.json").read_text())
        m["files"][rel] = {"size": 10, "sha256": "0" * 64}
        (ck / "checkpoint.json").write_text(json.dumps(m))
    return edit


_RELEASED = {  # folder edit → what the one-line refusal must name
    "dotdot": (_edit_index(lambda f, v: "../" + Path(_outside_shard(f, v)).relative_to(f.parent).as_posix()),
               ["weight_map", "outside"]),
    "absolute": (_edit_index(lambda f, v: _outside_shard(f, v)), ["weight_map", "outside"]),
    "passwd": (_edit_index(lambda f, v: PASSWD), ["weight_map", PASSWD]),
    "symlink_shard": (_symlink_shard, ["weight_map", "resolves outside"]),
    "symlink_tokenizer": (_symlink("tiktoken.model", PASSWD), ["tokenizer file", "outside"]),
    "symlink_config": (_symlink("config.json", PASSWD), ["config file", "outside"]),
    "experts": (_edit_text_config(num_experts=10**8), ["n_experts=100000000", "--force-memory"]),
    "layers": (_edit_text_config(num_hidden_layers=10**6), ["num_hidden_layers"]),
    "kda_layers_int": (_edit_text_config(**{"lac.kda_layers": 42}), ["kda_layers"]),
    "eps": (_edit_text_config(rms_norm_eps="abc"), ["rms_norm_eps"]),
    "hidden": (_edit_text_config(hidden_size=10**9), ["hidden_size=1000000000"]),
    "vocab": (_edit_text_config(vocab_size=10**12), ["vocab_size"]),
    "kda_heads": (_edit_text_config(**{"lac.num_heads": 10**6}), ["kda_num_heads=1000000"]),
    "conv": (_edit_text_config(**{"lac.short_conv_kernel_size": 10**6}), ["kda_conv_size"]),
    "deep": (lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000), ["nests deeper"]),
}


def _spec(path: str):
    def edit(ck: Path) -> None:
        (ck / "tokenizer_spec.json").write_text(json.dumps({"kind": "tiktoken", "path": path}))
    return edit


def _spec_symlink(ck: Path) -> None:
    (ck / "tokenizer_files").mkdir(exist_ok=True)
    (ck / "tokenizer_files" / "tok.model").symlink_to(PASSWD)


def _manifest_entry(rel: str, link: str | None = None):
    """Runs after the re-manifest: adds an entry naming ``rel`` (and a symlink ``link`` → outside)."""
    def edit(ck: Path) -> None:
        if link is not None:
            (ck / link).symlink_to(PASSWD)
        m = json.loads((ck / "checkpoint.json").read_text())
        m["files"][rel] = {"size": 10, "sha256": "0" * 64}
        (ck / "checkpoint.json").write_text(json.dumps(m))
    return edit


_RUNS = {  # (edit before re-manifesting, edit after, what the refusal must name)
    "spec_passwd": (_spec(PASSWD), None, ["tokenizer_spec.json path", PASSWD]),
    "spec_dotdot": (_spec("../../../../../../../../etc/passwd"), None, ["tokenizer_spec.json path", "'..'"]),
    "spec_symlink": (_spec("tokenizer_files/tok.model"), _spec_symlink,
                     ["tokenizer_spec.json path", "resolves outside"]),
    "manifest_abs": (None, _manifest_entry("/etc/hostname"), ["checkpoint.json entry", "/etc/hostname"]),
    "manifest_dotdot": (None, _manifest_entry("../../run.json"), ["checkpoint.json entry", "'..'"]),
    "manifest_symlink": (None, _manifest_entry("evil", link="evil"), ["checkpoint.json entry", "resolves outside"]),
}


@pytest.fixture(scope="module")
def outcome(tiny_run, tmp_path_factory):
    """Every folder of both tables built, then all commands in one child: (results by name, peak, before, root)."""
    root = tmp_path_factory.mktemp("untrusted")
    base = _released(root / "release")
    argv = {"release": ["generate", "--model", str(base), "--prompt", "ab", "--max-new-tokens", "2", "--dtype",
                        "float32"]}
    for name, (edit, _) in _RELEASED.items():
        argv[name] = [*argv["release"][:2], str(_variant(base, name, edit)), *argv["release"][3:]]
    for name, (edit, after, _) in _RUNS.items():
        ck = _checkpoint_variant(tiny_run, root / name, edit or (lambda ck: None))
        if after is not None:
            after(ck)
        argv[name] = ["generate", "--run", str(root / name), "--max-new-tokens", "2"]
    before = k3_runs.tree_digest(root)
    results, peak = k3_runs.run_cli_child(*argv.values())
    return dict(zip(argv, results)), peak, before, root


def test_released_folder_paths_and_absurd_configs(outcome):
    results, peak, before, root = outcome
    code, out, err = results["release"]
    assert code == 0 and out.startswith("ab"), err  # the untouched folder loads and generates
    for name, (_, needles) in _RELEASED.items():
        _check_refused(results[name], *needles)
    assert peak < 2 << 30, peak


def test_run_checkpoint_paths_stay_inside(outcome):
    results, peak, before, root = outcome
    for name, (_, _, needles) in _RUNS.items():
        _check_refused(results[name], *needles)
    assert str(Path("/etc/hostname").stat().st_size) + " bytes" not in results["manifest_abs"][2]
    assert k3_runs.tree_digest(root) == before  # nothing written, whatever was refused
    assert peak < 2 << 30, peak
