"""docs/results.md, "What a decoder shows": ``benchmarks/results/decoder_harness-*.json``, decoders side by side."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import describe_machine
from benchmarks.render.text import table

ORDER = ("cls", "tokenmap-32px-old", "tokenmap-28px")  # the CLS decoder first, then the token-map ones; others sorted


def _runs(results: Path) -> list[dict]:
    runs = {p.stem.removeprefix("decoder_harness-"): json.loads(p.read_text())
            for p in sorted(results.glob("decoder_harness-*.json"))}
    runs = {tag: r for tag, r in runs.items() if not r.get("quick")}
    return [runs[t] for t in ORDER if t in runs] + [r for t, r in sorted(runs.items()) if t not in ORDER]


def _judge(j: dict) -> str:
    low, high = j["ci95"]
    return f"{j['consistency']:.2f} [{low:.2f}, {high:.2f}] ({j['of_originals']:.2f})"


def section(results: Path) -> str:
    runs = _runs(results)
    if not runs:
        return ""
    lines = ["## What a decoder shows: re-encoded rank, class, sharpness, realism", "",
             ("`python -m benchmarks.evaluation.decoder_harness --bundle bundles/demo --decoder RUN --tag TAG`: one "
              "sample for each of 500 class-balanced Fashion-MNIST test images (guidance rows: the first 200), "
              "re-encoded and its conditioning image ranked among the 10,000 test images (RCDM's faithfulness "
              "measure: a decoder that keeps only the class sits near rank 500, a random one at 5,000); class "
              "consistency by the feature classifier and by kNN on raw pixels (95 % Wilson interval, and in "
              "brackets as a fraction of the judge's accuracy on the originals); high-frequency energy against the "
              "conditioning image's (1 = as sharp); KID against 2,000 other test images in the encoder's space; the "
              "spread of 4 samples of one image. *Class in the feature*: the classifier on the (masked) conditioning "
              "features themselves, the most of the class a decoder can keep. Tags `tokenmap-*`: decoders "
              "conditioned on the whole token map (CLS and the 4 x 4 patch tokens, the inpainting view), ranked in "
              "the token-map space they were handed, where a copy of the image ranks 1 by construction; `cls`: the "
              "default decoder, conditioned on the CLS vector alone, ranked in the CLS space and in raw pixels.")]
    new = any("pixel_median_rank" in row for r in runs for row in r["rows"])
    if new:  # the columns of the harness that measures in the representation's space (older files lack them)
        lines[-1] += (" *Feature*: the space the rank is measured in (the conditioning feature's); *condition's "
                      "rank*: the masked condition's own rank there; *pixel rank*: the rank in raw pixels (1: the "
                      "sample reproduces its source); *seed spread*: two samples of one condition apart, as a "
                      "fraction of two random test images. References on the same images: a decoder trained the "
                      "same way on the random-init twin, and a regression decoder from the same feature.")
    lines.append("")
    head = ["decoder", "mask", "guidance", "median rank", "R@1", "R@10", "classifier", "pixel kNN",
            "class in the feature", "sharpness", "KID", "spread"]
    if new:
        head[1:1], head[7:7], head[-3:-3] = ["feature"], ["condition's rank", "pixel rank"], ["seed spread"]
    rows = []

    def add(name: str, row: dict) -> None:
        def get(key: str, fmt: str) -> str:
            return format(row[key], fmt) if row.get(key) is not None else ""

        cells = [name, f"{row['ratio']:.1f}", f"{row['guidance']:g}", f"{row['median_rank']:.0f}",
                 f"{row['r_at_1']:.3f}", f"{row['r_at_10']:.3f}", _judge(row["classifier"]),
                 _judge(row["pixel_judge"]), get("classifier_on_condition", ".2f"), f"{row['sharpness_ratio']:.2f}",
                 f"{row['kid']:.4f}", get("spread", ".3f")]
        if new:
            cells[1:1], cells[7:7] = [row.get("feature", "")], [get("condition_median_rank", ".0f"),
                                                                  get("pixel_median_rank", ".0f")]
            cells[-3:-3] = [get("seed_spread", ".2f")]
        rows.append(cells)

    for r in runs:
        cfg = r["config"]
        name = f"{r['tag']} ({cfg['image_size']} px, {cfg['sampler']} {cfg['sample_steps']}, step {r['decoder_step']})"
        for row in r["rows"]:
            add(name, row)
        for ref, measured in r.get("references", {}).items():
            for row in measured["rows"]:
                add(f"{r['tag']}: reference {ref.replace('_', '-')} (step {measured['decoder_step']})", row)
    lines += [table(head, rows), ""]
    for r in runs:
        c = r["ceilings"]
        timing = r.get("app_8_samples_s_by_guidance")
        by = f" (by guidance: {', '.join(f'{g}: {s:.2f} s' for g, s in timing.items())})" if timing else ""
        lines.append(f"- {r['tag']}: 8 samples of one image at the app's defaults in {r['app_8_samples_s']:.2f} s{by}; "
                     f"the judges on the originals: classifier {c['classifier']:.2f}, pixel kNN "
                     f"{c['pixel_judge']:.2f}; KID real against real {r['kid_real_vs_real']:.4f}; "
                     f"![{r['tag']}: original, then a sample at each mask ratio](../benchmarks/results/{r['grid']}).")
    lines += ["", f"Machine: {describe_machine(runs[-1]['machine'])}.", ""]
    return "\n".join(lines)
