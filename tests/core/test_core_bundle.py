"""msn_core.bundle: msn.json round trip, validation errors that name the field, the graph's input contract."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from msn_core.bundle import (
    FORMAT_VERSION,
    Architecture,
    BundleError,
    BundleInfo,
    Preprocessing,
    check_graph_inputs,
    load_bundle_info,
    onnx_feeds,
    parse_bundle_info,
    write_bundle_info,
)

DOC = {
    "format_version": 2, "model_id": "msn-tiny4-0123456789ab",
    "architecture": {"name": "vit_tiny", "image_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2,
                     "num_heads": 4, "in_chans": 3, "mlp_ratio": 4.0},
    "preprocessing": {"resize": 36, "crop": 32, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "channels": 3,
                      "interpolation": "bicubic"},
    "feature": "cls_pre_norm", "onnx": {"opset": 18}, "weights": {"sha256": "ab"}, "parity": None,
}


def test_round_trip_keeps_every_field(tmp_path: Path):
    info = parse_bundle_info(copy.deepcopy(DOC))
    assert (info.grid, info.num_patches, info.embed_dim, info.in_chans) == (8, 64, 64, 3)
    assert info.extra == {"weights": {"sha256": "ab"}, "parity": None}
    assert info.architecture.encoder_kwargs() == {k: v for k, v in DOC["architecture"].items() if k != "name"}
    write_bundle_info(tmp_path, info)
    again = load_bundle_info(tmp_path)
    assert again == info and again.path == tmp_path and again.to_dict() == DOC
    assert json.loads((tmp_path / "msn.json").read_text()) == DOC


def test_format_1_bundles_are_still_read():
    assert parse_bundle_info({**DOC, "format_version": 1}).format_version == 1
    assert FORMAT_VERSION == 2


def _without(section: str, key: str) -> dict:
    doc = copy.deepcopy(DOC)
    del doc[section][key]
    return doc


@pytest.mark.parametrize("doc, needle", [
    ({**DOC, "format_version": 3}, "format_version 3"), ({k: v for k, v in DOC.items() if k != "format_version"},
                                                          "no format_version"),
    ({**DOC, "format_version": "2"}, "integer"), ({**DOC, "model_id": ""}, "model_id"),
    ({**DOC, "feature": "patch_mean"}, "feature"), (_without("architecture", "embed_dim"), "embed_dim"),
    ({**DOC, "architecture": {**DOC["architecture"], "patch_size": 5}}, "multiple of patch_size"),
    ({**DOC, "architecture": {**DOC["architecture"], "qkv_bias": False}}, "unknown architecture field"),
    ({**DOC, "architecture": {**DOC["architecture"], "depth": 0}}, "depth"),
    ({**DOC, "preprocessing": {**DOC["preprocessing"], "crop": 28, "resize": 28}}, "crop 28"),
    ({**DOC, "preprocessing": {**DOC["preprocessing"], "resize": 30}}, "resize 30"),
    ({**DOC, "preprocessing": {**DOC["preprocessing"], "std": [0.5, 0.0, 0.5]}}, "std"),
    ({**DOC, "preprocessing": {**DOC["preprocessing"], "mean": [0.5]}}, "one entry per channel"),
    ({**DOC, "preprocessing": {**DOC["preprocessing"], "channels": 1, "mean": [0.5], "std": [0.5]}}, "in_chans"),
    ({**DOC, "preprocessing": {**DOC["preprocessing"], "resize": "big"}}, "malformed"),
    (_without("preprocessing", "mean"), "mean"), ([DOC], "JSON object"),
])
def test_invalid_documents_name_the_problem(doc, needle):
    with pytest.raises(BundleError) as e:
        parse_bundle_info(doc, where="x/msn.json")
    assert needle in str(e.value) and str(e.value).startswith("x/msn.json: ")


def test_dataclasses_refuse_inconsistent_values():
    with pytest.raises(BundleError, match="channels"):
        Preprocessing(resize=32, crop=32, mean=(0.5,) * 2, std=(0.5,) * 2, channels=2)
    with pytest.raises(BundleError, match="num_heads"):
        Architecture(name="x", image_size=32, patch_size=4, embed_dim=65, depth=1, num_heads=4)
    info = parse_bundle_info(DOC)
    with pytest.raises(BundleError, match="format_version"):
        BundleInfo(model_id="m", architecture=info.architecture, preprocessing=info.preprocessing, format_version=9)


def test_loading_reports_missing_files_and_bad_json(tmp_path: Path):
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle_info(tmp_path / "nope")
    with pytest.raises(BundleError, match=r"not an MSN bundle \(no msn.json\)"):
        load_bundle_info(tmp_path)
    (tmp_path / "msn.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle_info(tmp_path)
    (tmp_path / "msn.json").write_text(json.dumps(DOC))
    with pytest.raises(BundleError, match="no model.onnx"):
        load_bundle_info(tmp_path, need=("model.onnx",))


def test_onnx_feeds_for_both_graph_formats():
    pixels = np.zeros((2, 3, 8, 8), dtype=np.float64)
    keep = np.array([[0, 1, 2], [5, -1, -1]])
    v2 = onnx_feeds({"pixel_values", "keep_idx"}, pixels, keep)
    assert sorted(v2) == ["keep_idx", "pixel_values"] and v2["pixel_values"].dtype == np.float32
    assert v2["keep_idx"].dtype == np.int64 and v2["keep_idx"].tolist() == keep.tolist()
    v1 = onnx_feeds({"pixel_values", "keep_idx", "keep_mask"}, pixels, keep)
    assert v1["keep_idx"].tolist() == [[0, 1, 2], [5, 0, 0]]
    assert v1["keep_mask"].tolist() == [[True, True, True], [True, False, False]]
    check_graph_inputs({"pixel_values", "keep_idx"})
    check_graph_inputs({"pixel_values", "keep_idx", "keep_mask"})
    with pytest.raises(BundleError, match="expected"):
        check_graph_inputs({"pixel_values"})
    with pytest.raises(BundleError, match="expected"):
        check_graph_inputs({"pixel_values", "keep_idx", "attention_mask"})


INT8 = {"file": "model.int8.onnx", "method": "dynamic", "guard": {"passed": True, "cosine": {"min": 0.999}},
        "speed": {"batch": 32}}


def test_int8_section_round_trips_and_names_its_graph(tmp_path: Path):
    info = parse_bundle_info({**copy.deepcopy(DOC), "int8": INT8}, path=tmp_path)
    assert info.int8 is not None and info.int8.method == "dynamic" and info.int8.details == {"speed": {"batch": 32}}
    assert info.to_dict() == {**DOC, "int8": INT8} and "int8" not in info.extra
    assert info.precisions == ("fp32", "int8") and parse_bundle_info(DOC).precisions == ("fp32",)
    assert info.graph_path("fp32") == tmp_path / "model.onnx"
    with pytest.raises(BundleError, match="missing"):
        info.graph_path("int8")
    (tmp_path / "model.int8.onnx").write_bytes(b"")
    assert info.graph_path("int8") == tmp_path / "model.int8.onnx"
    with pytest.raises(BundleError, match="no int8 graph.*--quantize int8"):
        parse_bundle_info(DOC, path=tmp_path).graph_path("int8")
    with pytest.raises(BundleError, match="precision"):
        info.graph_path("fp16")


@pytest.mark.parametrize("section, needle", [
    ({**INT8, "guard": {"passed": False}}, "passed accuracy guard"), ({**INT8, "method": "magic"}, "int8.method"),
    ({**INT8, "file": "model.onnx"}, "int8.file"), ({**INT8, "file": "../x.onnx"}, "int8.file"),
    ({k: v for k, v in INT8.items() if k != "guard"}, "guard"),
])
def test_int8_sections_that_cannot_be_served_are_refused(section, needle):
    with pytest.raises(BundleError, match=needle):
        parse_bundle_info({**DOC, "int8": section})


def test_feature_layouts_add_up_to_the_feature_width():
    from msn_core.features import feature_dim, feature_layout

    for name in ("cls_pre_norm", "cls_post_norm", "cls_last2", "patch_tokens", "cls_patch_tokens", "patch_grid2"):
        layout = feature_layout(name, embed_dim=12, depth=4, grid=4)
        assert layout.global_dim + layout.map_dim == feature_dim(name, embed_dim=12, depth=4, grid=4), name
    assert feature_layout("cls_patch_tokens", embed_dim=12, depth=4, grid=4).side == 4
