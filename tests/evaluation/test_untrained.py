"""``msn-eval --untrained [SEED]``: the bundle's architecture, preprocessing and feature with random-init weights,
scored with the same protocol, never mistaken for (or cached as) the trained bundle.

``tiny_bundle`` is itself a random init under ``torch.manual_seed(0)``, so seed 0 reproduces its weights exactly
(which checks that the twin is exactly its architecture) and seed 1 gives other weights.
"""

import json

import numpy as np
import pytest

from msn_core.bundle import load_bundle_info
from training.bundle.untrained import SOURCE_KIND
from training.evaluation.cli import build_parser, main, make_context
from training.evaluation.untrained import twin_key, untrained_twin


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: twins are exported once per seed."""
    return tmp_path_factory.mktemp("untrained-cache")


def _common(bundle, cache, *extra):
    return ["--bundle", str(bundle), "--data", "synthetic", "--synthetic-size", "40", "--max-test", "20",
            "--cache-dir", str(cache), "--no-progress", *extra]


@pytest.mark.parametrize("backend", [[], ["--backend", "torch", "--feature", "cls_pre_norm"]],
                         ids=["onnx", "torch-cls"])
def test_lowshot_and_knn_of_the_untrained_control(tiny_bundle, cache, tmp_path, capsys, backend):
    out = tmp_path / "r.json"
    for command in (["lowshot", "--shots", "1", "--splits", "1"], ["knn", "--k", "5"]):
        assert main([*command, *_common(tiny_bundle, cache, *backend, "--untrained", "1", "--json", str(out))]) == 0
        report, printed = json.loads(out.read_text()), capsys.readouterr()
        assert report["weights"] == "untrained (random init, seed 1)" and report["untrained_seed"] == 1
        assert report["backend"] == (backend[1] if backend else "onnx") and report["feature"] == "cls_pre_norm"
        assert report["bundle"] == str(tiny_bundle) and report["untrained_bundle"].startswith(str(cache))
        assert printed.out.startswith("untrained control:") and "seed 1" in printed.out.splitlines()[0]
        assert "untrained (random init, seed 1)" in printed.err
        row = report["results"][0]
        assert 0 <= row.get("mean", row.get("top1")) <= 100
    main(["knn", *_common(tiny_bundle, cache, *backend, "--json", str(out))])
    assert json.loads(out.read_text())["weights"] == "trained" and "untrained" not in capsys.readouterr().err


def _context(bundle, cache, *extra):
    return make_context(build_parser().parse_args(["knn", *_common(bundle, cache, *extra)]))


def test_untrained_features_differ_repeat_and_never_share_the_cache(tiny_bundle, cache):
    """Two twin exports (each a torch process and an ONNX export): seed 1 through the cache, seed 0 with
    ``--no-cache``, which exports afresh in a temporary directory and leaves the cache without it."""
    info = load_bundle_info(tiny_bundle)
    trained = _context(tiny_bundle, cache)
    first = trained.test_features()
    assert trained.test_features().from_cache
    other = _context(tiny_bundle, cache, "--untrained", "1")
    one = other.test_features()  # other weights: the trained bundle's cache entry would show here
    assert not np.allclose(one.features, first.features, atol=1e-3)
    same_init = _context(tiny_bundle, cache, "--untrained", "0", "--no-cache")  # the fixture's own init
    assert same_init.untrained_bundle is None and not (cache / "untrained" / twin_key(info, 0)).exists()
    np.testing.assert_allclose(same_init.test_features().features, first.features, atol=1e-5)  # equal weights ...
    assert len({trained.cache_tag, same_init.cache_tag, other.cache_tag}) == 3  # ... but never its cache entry


def test_the_twin_is_the_bundle_with_random_weights(tiny_bundle, cache):
    ref = load_bundle_info(tiny_bundle)
    twin = untrained_twin(tiny_bundle, 1, cache)
    assert untrained_twin(tiny_bundle, 1, cache) == twin  # reused
    assert twin == cache / "untrained" / twin_key(ref, 1) and twin_key(ref, 0) != twin_key(ref, 1)
    assert not [p for p in twin.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    info = load_bundle_info(twin)
    assert (info.architecture, info.preprocessing, info.feature) == (ref.architecture, ref.preprocessing, ref.feature)
    assert info.extra["source"]["kind"] == SOURCE_KIND and info.model_id != ref.model_id


def test_untrained_flag_parsing_and_pixels_refused(tiny_bundle, tmp_path):
    parse = build_parser().parse_args
    base = ["knn", "--bundle", "b", "--data", "synthetic"]
    assert parse(base).untrained is None
    assert parse([*base, "--untrained"]).untrained == 0
    assert parse([*base, "--untrained", "7", "--k", "3"]).untrained == 7
    with pytest.raises(SystemExit, match="raw pixels"):
        main(["knn", *_common(tiny_bundle, tmp_path, "--backend", "pixels", "--untrained")])
