from pathlib import Path

import pytest

from training.config import Config, ConfigError, config_from_dict, load_config

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
                 if not p.name.startswith("rcdm_"))  # decoder configs: tests/visualizer


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path, ["data.root=/tmp/x"] if "in1k" in path.name else [])
    assert isinstance(cfg, Config)


def test_paper_settings_per_model():
    expected = {"in1k_vit_s16": (0.15, 16), "in1k_vit_b16": (0.3, 16), "in1k_vit_b8": (0.3, 8),
                "in1k_vit_b4": (0.7, 4), "in1k_vit_l7": (0.7, 7)}
    for name, (ratio, patch) in expected.items():
        cfg = load_config(Path(CONFIGS[0]).parent / f"{name}.yaml")
        assert (cfg.mask.ratio, cfg.model.patch_size, cfg.mask.num_focal) == (ratio, patch, 10)
        assert cfg.model.image_size % patch == 0 and cfg.mask.focal_size % patch == 0


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["data.source=synthetic", "optim.lr=1e-3", "mask.rand_crop_scale=[0.5, 1.0]",
                             "run.max_steps=3", "model.depth=2", "optim.fused=null"])
    assert cfg.optim.lr == 1e-3 and cfg.mask.rand_crop_scale == [0.5, 1.0]
    assert cfg.run.max_steps == 3 and cfg.model.depth == 2 and cfg.optim.fused is None


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="optim.lrr"):
        load_config(None, ["data.source=synthetic", "optim.lrr=0.1"])
    with pytest.raises(ConfigError, match="unknown config key bogus"):
        load_config(None, ["bogus.x=1"])


def test_wrong_types_are_named():
    with pytest.raises(ConfigError, match="run.max_steps"):
        load_config(None, ["data.source=synthetic", "run.max_steps=many"])
    with pytest.raises(ConfigError, match="mask.shared"):
        load_config(None, ["data.source=synthetic", "mask.shared=3"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["optim.lr"])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="multiple of model.patch_size"):
        load_config(None, ["data.source=synthetic", "model.image_size=30", "model.patch_size=4"])
    with pytest.raises(ConfigError, match="mask.ratio"):
        load_config(None, ["data.source=synthetic", "mask.ratio=1.0"])
    with pytest.raises(ConfigError, match="data.root"):
        load_config(None, [])


def test_round_trip_through_dict():
    cfg = load_config(None, ["data.source=synthetic", "mask.ratio=0.5"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_small_image_recipe_follows_the_image_size():
    """The recipe moves to another image size by one key: patch grid, load size and eval preprocessing follow."""
    from training.run.build import preprocessing

    recipe = Path(CONFIGS[0]).parent / "fmnist_vit_tiny.yaml"
    for size, patch in ((28, 7), (32, 8), (64, 16)):
        cfg = load_config(recipe, [f"model.image_size={size}"])
        assert (cfg.model.patch_size, cfg.data.load_size) == (patch, size)
        assert (preprocessing(cfg, [0.5], [0.5])["resize"], preprocessing(cfg, [0.5], [0.5])["crop"]) == (size, size)
        assert config_from_dict(cfg.to_dict()).model.patch_size == patch  # checkpoints restore the derived value
    with pytest.raises(ConfigError, match="patches_per_side"):
        load_config(recipe, ["model.image_size=30"])
