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


def test_set_takes_several_pairs_after_one_flag_and_repeats():
    """``--set a=1 b=2`` (README, the demo config and the docs) and ``--set a=1 --set b=2`` are the same."""
    from training.pretrain import parse_args

    one_flag = parse_args(["--output-dir", "o", "--set", "data.source=synthetic", "optim.lr=2e-3", "--resume"])
    assert one_flag.overrides == ["data.source=synthetic", "optim.lr=2e-3"] and one_flag.resume
    mixed = parse_args(["--output-dir", "o", "--set", "data.source=synthetic", "run.seed=1", "--set", "run.seed=2"])
    assert mixed.overrides == ["data.source=synthetic", "run.seed=1", "run.seed=2"]
    assert load_config(None, mixed.overrides).run.seed == 2  # the later one wins
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", "o", "--set"])  # a flag without a pair
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, ["data.source=synthetic", "mask.rand_crop_scale=[0.5, 1"])


def test_visualizer_set_takes_several_pairs_too():
    from visualizer.cli import _parser

    args = _parser().parse_args(["train", "--bundle", "b", "--output-dir", "o", "--set", "a.b=1", "c.d=2",
                                 "--set", "e.f=3"])
    assert args.overrides == ["a.b=1", "c.d=2", "e.f=3"]


def test_data_flag_builds_the_data_section(tmp_path):
    """``--data DIR`` = data.source auto + data.root DIR (absolute), under the YAML and over by ``--set``."""
    from training.pretrain import parse_args, resolve_config

    (tmp_path / "images").mkdir()
    recipe = Path(CONFIGS[0]).parent / "fmnist_vit_tiny.yaml"
    with pytest.raises(ConfigError, match="needs a length"):  # no --config: the run is planned (test_plan.py)
        resolve_config(parse_args(["--output-dir", "o", "--data", str(tmp_path / "images")]))
    cfg, _ = resolve_config(parse_args(["--output-dir", "o", "--config", str(recipe), "--data",
                                        str(tmp_path / "images"), "--set", "data.source=folder",
                                        "model.image_size=32"]))
    assert (cfg.data.source, cfg.model.image_size, cfg.model.patches_per_side) == ("folder", 32, 4)
    cfg, _ = resolve_config(parse_args(["--output-dir", "o", "--data", "synthetic", "--epochs", "1"]))
    assert (cfg.data.source, cfg.data.root) == ("synthetic", None)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_config(parse_args(["--output-dir", "o", "--data", str(tmp_path / "missing")]))
    for source in ("folder", "file_list", "auto"):
        with pytest.raises(ConfigError, match="data.root is required"):
            load_config(None, [f"data.source={source}"])
    with pytest.raises(ConfigError, match="data.source='cifar'"):
        load_config(None, ["data.source=cifar"])
