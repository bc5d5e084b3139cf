"""The own-images sections of docs/results.md: a flat folder (``benchmarks/results/flat_folder-*.json``, from
``python -m benchmarks.training.flat_folder``), other small images (``other_folders-*.json``), rendered glyphs
(``glyph_folders-*.json``) and the warm start (``warm_start.json``)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import machine_line

SETTINGS = [("1imgs_class", "1 label"), ("2imgs_class", "2 labels"), ("5imgs_class", "5 labels")]


def _row(name: str, evals: dict, which: str) -> str:
    lowshot = {r["setting"]: r for r in evals[f"{which}-lowshot"]["results"]}
    cells = [f"{lowshot[s]['mean']:.1f} ± {lowshot[s]['std']:.1f}" for s, _ in SETTINGS]
    knn = evals[f"{which}-knn"]["results"][0]["top1"]
    return f"| {name} | " + " | ".join(cells) + f" | {knn:.1f} |"


def _used(run: dict, budget_min: float) -> str:
    used = run.get("trainer_budget_seconds_used")
    own = (f"the trainer counted {used / 60:.2f} min ({100 * used / 60 / budget_min:.1f} %; first length "
           f"{run['planned_total_steps']:,} steps, resized {run['replans']} times), " if used else "")
    return own + f"torchrun's wall clock {run['wall_minutes']:.2f} min (process start and imports included)"


def section(results: Path) -> str:
    reports = sorted(results.glob("flat_folder-*.json"), key=lambda p: json.loads(p.read_text())["run"]
                     .get("wall_minutes", 0))
    if not reports:
        return ""
    lines = ["## Your own images: a flat folder, no config", "",
             ("`python -m benchmarks.training.flat_folder --budget B`: the 60,000 Fashion-MNIST training images "
              "written as one flat folder of PNGs with no labels, then `torchrun --nproc_per_node=1 "
              "training/pretrain.py --data DIR --budget B` with no config and no `--set` (the run is planned from the "
              "images and the machine), `msn-export`, and the official low-shot protocol (3 splits, the full 10k "
              "test set) and kNN-20 against the 60k, on the feature the bundle serves and on raw pixels under the "
              "same preprocessing. One run per budget."), ""]
    for path in reports:
        r = json.loads(path.read_text())
        run = r["run"]
        budget_min = float(r["budget"].rstrip("m"))
        lines += [f"### Budget {r['budget']}", "", machine_line(r["machine"]), "",
                  (f"{run['steps']:,} steps at {run['images_per_sec']:.0f} images/s. Budget "
                   f"{budget_min:g} min: {_used(run, budget_min)}. Served feature: "
                   f"`{r['evals']['flat-lowshot'].get('feature', 'as msn.json says')}`."), "",
                  "| | " + " | ".join(label for _, label in SETTINGS) + " | kNN-20 |",
                  "|---|---|---|---|---|",
                  _row("MSN, flat folder, planned", r["evals"], "flat"),
                  _row("raw pixels", r["evals"], "pixels"), ""]
    return "\n".join(lines)


def _views(config: dict) -> str:
    """The planned views, for the plan column: crops, masking, whether photometric jitter is on, and the views
    off the official recipe (levels redrawn, pose and stroke jitter)."""
    mask, augment = config.get("mask"), config.get("augment")
    if not mask or not augment:
        return ""
    jitter = "" if augment.get("blur_p") or augment.get("color_jitter_p") else ", no photometric jitter"
    extra = "".join(text for key, text in (("levels_p", ", levels redrawn"), ("affine_p", ", rotation and shear"),
                                           ("stroke_p", ", stroke jitter")) if augment.get(key))
    return f", crops {mask['rand_crop_scale'][0]:g}-1, {mask['ratio']:.0%} masked{jitter}{extra}"


def _folders_table(r: dict) -> list[str]:
    """One budget's table of a folders report (``other_folders``, ``glyph_folders``): per folder the plan, its
    steps, the collapse detector's verdict and the scores of the bundle and of raw pixels."""
    sets = f", with `--set {' '.join(r['sets'])}`" if r.get("sets") else ""
    lines = [f"### Budget {r['budget']}{sets}", "", machine_line(r["machine"]), "",
             "| folder | plan | steps | collapse | " + " | ".join(lbl for _, lbl in SETTINGS) + " | kNN-20 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, f in r["folders"].items():
        config, run = f["config"], f["run"]
        plan = (f"{config['model']['arch']}, {config['model']['image_size']} px, "
                f"{config['model']['patches_per_side']}² patches{_views(config)}")
        collapse = f"at step {run['collapse']['step']:,}" if run.get("collapse") else "none"
        for which, label in (("flat", f"{name} MSN"), ("pixels", f"{name} raw pixels")):
            row = _row(label, f["evals"], which)
            if which == "flat":
                row = row.replace(f"| {label} |", f"| {label} | {plan} | {run['steps']:,} | {collapse} |", 1)
            else:
                row = row.replace(f"| {label} |", f"| {label} | | | |", 1)
            lines.append(row)
    return [*lines, ""]


def other_folders_section(results: Path) -> str:
    """``benchmarks/results/other_folders-*.json`` (``python -m benchmarks.training.other_folders``)."""
    reports = sorted(results.glob("other_folders-*.json"))
    if not reports:
        return ""
    lines = ["## Other small images: the same plan off Fashion-MNIST", "",
             ("`python -m benchmarks.training.other_folders`: scikit-learn's handwritten digits (1,797 grey 8 x 8 "
              "images, the only other labelled image set on this machine), written at 8 px and resampled to 32 px; "
              "2/3 of them (stratified, seed 0) as one unlabelled flat folder, pretrained with `--data DIR --budget "
              "B` and nothing else; the other third is the test set. Low-shot: 3 seeded per-class samples of the "
              "training part; kNN-20 against the whole training part. One rule of the plan was found on these "
              "images (views that keep most of an image holding little detail, [results-notes](results-notes.md)); "
              "nothing else in it was tuned on them. The plan upsamples both to 32 px, and raw pixels are scored "
              "under the bundle's "
              "preprocessing, so the two folders share one pixel baseline."), ""]
    for path in reports:
        lines += _folders_table(json.loads(path.read_text()))
    return "\n".join(lines)


def glyph_folders_section(results: Path) -> str:
    """``benchmarks/results/glyph_folders-*.json`` (``python -m benchmarks.training.glyph_folders``); nothing
    until a run is filed."""
    reports = [json.loads(p.read_text()) for p in sorted(results.glob("glyph_folders-*.json"))]
    reports.sort(key=lambda r: bool(r.get("sets")))  # the plan first, then runs with --set
    if not reports:
        return ""
    images = next(iter(reports[0]["folders"].values()))["images"]
    sizes = "/".join(str(s) for s in images["sizes"])
    lines = ["## Rendered glyphs: the same plan on a folder of mixed sizes", "",
             (f"`python -m benchmarks.training.glyph_folders`: the digits 0-9 drawn with Pillow in "
              f"{len(images['fonts'])} fonts ({', '.join(images['fonts'])}) with affine, stroke and contrast "
              f"jitter, light on dark, grey, {sizes} px mixed in one folder; {images['train']:,} training images "
              f"as an unlabelled folder (`glyphs-flat`: one flat folder; `glyphs-nested`: the same files two "
              f"folders deep), pretrained with `--data DIR --budget B` and nothing else, and {images['test']:,} "
              "test images, both balanced over classes, sizes and fonts. Low-shot: 3 seeded per-class samples of "
              "the training part; kNN-20 against the whole training part; raw pixels under the bundle's "
              "preprocessing. One rule of the plan was found on these images (redrawn levels for plain "
              "backgrounds of differing grey, [results-notes](results-notes.md)); nothing else in it was tuned on "
              "them."), ""]
    for r in reports:
        lines += _folders_table(r)
    return "\n".join(lines)


def warm_start_section(results: Path) -> str:
    """``benchmarks/results/warm_start.json`` (``python -m benchmarks.training.warm_start``, the default
    schedules) beside ``warm_start_gentle.json`` (the same run with ``--set optim.warm_lr_scale=0.5 ...``)."""
    path = results / "warm_start.json"
    if not path.exists():
        return ""
    r = json.loads(path.read_text())
    gentle_path = results / "warm_start_gentle.json"
    gentle = json.loads(gentle_path.read_text()) if gentle_path.exists() else None
    other = gentle["comparison"]["metrics"] if gentle else {}
    rows = []
    for metric, v in r["comparison"]["metrics"].items():
        o = other.get(metric)
        rows.append(f"| {metric} | {v['source']:.1f} | {v['warm']:.1f} | {v['delta']:+.1f} | "
                    + (f"{o['warm']:.1f} | {o['delta']:+.1f} |" if o else "| |"))
    metrics = r["comparison"]["metrics"].values()
    verdict = ("at least the source's on every metric" if r["comparison"]["warm_at_least_source"] else
               f"at least the source's on {sum(v['delta'] >= 0 for v in metrics)} of {len(metrics)} metrics")
    extra = (f" The last two columns: the same run with `--set {' '.join(gentle['overrides'])}` "
             f"({gentle['run']['steps']:,} steps)." if gentle else "")
    return "\n".join([
        "## Warm start: a further budget from a finished run", "", machine_line(r["machine"]), "",
        (f"`python -m benchmarks.training.warm_start`: `--init-from {r['source_checkpoint'].split('/main/')[-1]}` "
         f"(recipe `{r['config'].split('/main/')[-1]}`), {r['minutes']:g} more minutes on the same images with a "
         f"fresh optimiser and the recipe's schedules ({r['run']['steps']:,} steps). Served feature (`served/`) "
         f"and the paper's last-block CLS (`cls/`), official low-shot protocol and kNN-20. The warm-started bundle "
         f"scores {verdict}.{extra}"),
        "",
        "| metric | source | warm start | change | gentler schedules | change |", "|---|---|---|---|---|---|",
        *rows, ""])
