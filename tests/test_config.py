import json
import math

import pytest

from k3 import K3Config
from k3.config import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name: str) -> None:
    cfg = K3Config.from_preset(name)
    assert K3Config.from_json(cfg.to_json()) == cfg
    assert K3Config.from_dict(json.loads(cfg.to_json())) == cfg


def test_k3_layer_pattern_matches_release() -> None:
    cfg = K3Config.from_preset("k3")
    one_based_mla = [i + 1 for i in cfg.mla_layers]
    assert one_based_mla == list(range(4, 93, 4)) + [93]
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
    assert cfg.layer_type(0) == "kda" and cfg.layer_type(3) == "mla" and cfg.layer_type(92) == "mla"
    assert not cfg.is_moe(0) and cfg.is_moe(1) and cfg.is_moe(92)
    assert cfg.shared_dim == 6144
    assert K3Config.from_preset("k3-linear").mla_layers == ()


def test_json_file_round_trip(tmp_path) -> None:
    cfg = K3Config.from_preset("tiny")
    p = tmp_path / "c.json"
    cfg.to_json(p)
    assert K3Config.from_json(p) == cfg


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", 0),
        ("num_layers", -1),
        ("top_k", 8),  # == n_experts in tiny
        ("kda_gate_lower_bound", 0.0),
        ("kda_gate_lower_bound", -6.0),
        ("rms_norm_eps", math.nan),
        ("situ_beta1", math.inf),
        ("mla_layers", (3, 3)),
        ("mla_layers", (4,)),
        ("dtype", "int8"),
        ("bos_token_id", 10_000),
    ],
)
def test_inconsistent_fields_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        K3Config.from_preset("tiny", **{field: value})


def test_unknown_preset_and_fields() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        K3Config.from_preset("k4")
    with pytest.raises(ValueError, match="unknown field"):
        K3Config.from_dict({"hidden_sise": 3})
    with pytest.raises(ValueError, match="JSON"):
        K3Config.from_json("{not json")
    with pytest.raises(TypeError):
        K3Config(7168)  # keyword-only
