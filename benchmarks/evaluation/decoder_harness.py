"""A decoder measured in its representation's space: faithfulness, what varies, class kept, against two references.

    python -m benchmarks.evaluation.decoder_harness --bundle bundles/demo --decoder runs/measure/cls --tag cls \
        --random-init runs/measure-untrained/cls --random-init-bundle bundles/demo-untrained \
        --regression runs/measure/regression       # the runs: docs/visualizer.md, "The decoder"
    python -m benchmarks.evaluation.decoder_harness --bundle B --decoder D --quick      # a smoke run, a minute
    python -m benchmarks.evaluation.decoder_harness ... --images 10 --gallery 200 ...  # any size (the sizes group)

On Fashion-MNIST: ``--images`` class-balanced test images (500) condition one sample each, at mask ratios 0, 0.5,
0.7 and 0.9 (the keep rows seeded per image), with the decoder's own sampler at its default guidance (the app's),
and unmasked at guidance 1, 2 and 3 (the first ``--guidance-images``, 200) when the decoder learned an unconditional
branch. Per setting (:mod:`visualizer.measures` defines each figure):

- faithfulness in the conditioning feature's space (``cond.feature``; for the paper's decoder the CLS): each sample
  re-encoded and its source ranked among the 10,000 test images (median rank, R@1, R@10; a decoder that keeps
  only the class ranks near 500, a random one 5,000), beside the masked condition's own rank (the same ranking of
  the masked image's feature: what the condition still says about its source), the rank by the bundle's served
  feature (read in the same forward pass) and the rank in raw pixels (1: the sample reproduces its source);
- what varies: the seed spread, the RMS pixel distance between two samples of one condition (the first
  ``--spread-images``, 100) as a fraction of the distance between two random test images;
- class kept: the feature classifier's consistency (a low-shot logistic regression in the conditioning space, on
  100 labelled training images per class), with its 95 % interval and as a fraction of the classifier's accuracy on
  the originals; and the pixel judge's (weighted kNN-10 on raw pixels against the 60,000 training images), likewise;
- sharpness: sample against source high-frequency energy, paired (1 = as sharp);
- realism: KID in the conditioning space against 2,000 other test images, beside real against real.

The references, on the same images, masks and seeds: ``--random-init`` a decoder trained the same way on the
bundle's random-init twin (``python -m training.bundle.untrained``), ranked in its own conditioning space and judged
by the same classifier and pixel judge; ``--regression`` a plain regression decoder from the same feature
(``model.kind=regression``: MSE, one output, faithful and blurry). Then the wall time of 8 samples of one image at
the app's default settings, and the issue's targets, each with its value and whether it is met. Writes
``benchmarks/results/decoder_harness-TAG.json`` and a grid of samples beside it; ``python -m benchmarks.render``
puts the table into docs/results.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, machine, save_json
from msn_core.lowshot import fit_logistic
from training.data import FashionMNIST
from training.masking import random_keep_idx
from visualizer.measures import (
    PixelJudge,
    kid,
    pixel_vectors,
    random_pair_distance,
    recall_at,
    reencoded_ranks,
    seed_spread,
    sharpness_ratio,
    wilson,
)
from visualizer.quality import balanced

if TYPE_CHECKING:
    from visualizer.features import FrozenEncoder
    from visualizer.pipeline import RCDMPipeline

RATIOS = (0.0, 0.5, 0.7, 0.9)
GUIDANCE = (1.0, 2.0, 3.0)  # unmasked rows by guidance scale, for a decoder trained with condition dropout
# The sizes of a measurement; --quick (a smoke run: it checks the harness, not the decoder) takes the second.
FULL = {"images": 500, "gallery": 10_000, "labelled_per_class": 100, "judge_bank": 60_000, "kid_images": 2000,
        "spread_images": 100, "pairs": 2000, "guidance_images": 200, "timing_repeats": 3}
QUICK = {"images": 40, "gallery": 1000, "labelled_per_class": 20, "judge_bank": 5000, "kid_images": 300,
         "spread_images": 10, "pairs": 500, "guidance_images": 20, "timing_repeats": 1}


def rgb(images: np.ndarray) -> torch.Tensor:
    """Grey uint8 (N, H, W) -> uint8 (N, 3, H, W), as the decoder's data and the service see them."""
    return torch.tensor(images, dtype=torch.uint8).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def to_size(samples: torch.Tensor, size: int) -> np.ndarray:
    """uint8 (N, 3, S, S) samples -> grey uint8 (N, size, size) (antialiased bicubic, as the encoder resizes)."""
    grey = samples.float().mean(dim=1, keepdim=True)
    if grey.shape[-1] != size:
        grey = F.interpolate(grey, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return grey.clamp(0, 255).round().to(torch.uint8)[:, 0].numpy()


class Space:
    """An encoder's conditioning space over the gallery: its features of every gallery image (and, for the main
    bundle, the served feature's too, read in the same forward pass)."""

    def __init__(self, encoder: FrozenEncoder, gallery_images: np.ndarray, *, served: bool = False):
        self.encoder, self.with_served = encoder, served and encoder.served != encoder.feature
        self.feats, self.served = self.embed(rgb(gallery_images))

    def embed(self, images_uint8: torch.Tensor, keep: torch.Tensor | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(conditioning features, served features or None)`` of uint8 images, ``keep`` rows (B, K) or None."""
        feats, served = [], []
        for i in range(0, len(images_uint8), 256):
            rows = None if keep is None else keep[i:i + 256]
            if self.with_served:
                own, other = self.encoder.embed_with_served(images_uint8[i:i + 256], rows)
                served.append(other.cpu())
            else:
                own = self.encoder.embed(images_uint8[i:i + 256], rows)
            feats.append(own.cpu())
        return torch.cat(feats).numpy(), torch.cat(served).numpy() if served else None


class Harness:
    """The fixed parts of a measurement: data, gallery (features and pixels), judges, the images that condition."""

    def __init__(self, pipe: RCDMPipeline, sizes: dict, seed: int, steps: int | None = None):
        self.pipe, self.seed, self.sizes, self.steps = pipe, seed, sizes, steps
        train, test = FashionMNIST(split="train"), FashionMNIST(split="test")
        rng = np.random.default_rng(seed)
        n_gallery = min(sizes["gallery"], len(test))
        self.gallery_images, self.gallery_labels = test.images[:n_gallery], test.labels[:n_gallery]
        images = min(sizes["images"], n_gallery)
        self.chosen = balanced(self.gallery_labels, -(-images // 10), rng, np.array([], dtype=np.int64))[:images]
        self.others = rng.permutation(np.setdiff1d(np.arange(n_gallery), self.chosen))[: sizes["kid_images"]]
        self.gallery_pixels = pixel_vectors(self.gallery_images)
        self.pair_distance = random_pair_distance(self.gallery_images, pairs=sizes["pairs"], seed=seed)
        self.main = Space(pipe.encoder, self.gallery_images, served=True)
        labelled = balanced(train.labels, sizes["labelled_per_class"], rng, np.array([], dtype=np.int64))
        labelled_feats = Space(pipe.encoder, train.images[labelled]).feats
        self.classifier = fit_logistic(labelled_feats, train.labels[labelled])
        bank = np.arange(len(train)) if sizes["judge_bank"] >= len(train) else \
            rng.permutation(len(train))[: sizes["judge_bank"]]
        self.judge = PixelJudge(train.images[bank], train.labels[bank])
        self.labels = self.gallery_labels[self.chosen]
        self.sources = self.gallery_images[self.chosen]
        feats = self.main.feats[self.chosen]
        self.ceilings = {"classifier": float(np.mean(self.classifier.predict(feats) == self.labels)),
                         "pixel_judge": float(np.mean(self.judge.predict(self.sources) == self.labels))}
        half = len(self.others) // 2
        self.kid_floor = kid(self.main.feats[self.others[:half]], self.main.feats[self.others[half:]])

    def keep_rows(self, ratio: float, count: int, salt: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + round(ratio * 100) + salt)
        return random_keep_idx(count, self.pipe.encoder.num_patches, ratio, shared=False, generator=generator)

    def samples(self, pipe: RCDMPipeline, cond: torch.Tensor, guidance: float, seed: int) -> torch.Tensor:
        """Samples of ``cond`` rows in chunks of 128 (chunk i seeded ``seed + i``), at ``--steps`` or the decoder's."""
        return torch.cat([pipe.sample_from_features(chunk, guidance_scale=guidance, seed=seed + i, steps=self.steps)
                          for i, chunk in enumerate(cond.split(128))])

    def measure(self, ratio: float, guidance: float, images: int | None = None, *, pipe: RCDMPipeline | None = None,
                space: Space | None = None) -> tuple[dict, torch.Tensor]:
        """One sample of ``pipe`` (the measured decoder by default; a reference with its own ``space``) for each of
        the first ``images`` chosen images (all by default; the order is class-balanced) at ``ratio`` and
        ``guidance``, and a second one for the first ``spread_images``: every figure of the module docstring."""
        started = time.perf_counter()
        pipe, space = pipe or self.pipe, space or self.main
        n = min(images or len(self.chosen), len(self.chosen))
        chosen, sources, labels = self.chosen[:n], self.sources[:n], self.labels[:n]
        keep = self.keep_rows(ratio, n)
        cond_np, _ = space.embed(rgb(sources), keep)
        cond = torch.from_numpy(cond_np)
        k = min(self.sizes["spread_images"], n)  # a second sample of the first k conditions (other noise rows)
        both = self.samples(pipe, torch.cat([cond, cond[:k]]), guidance, seed=self.seed)
        samples, again = both[:n], to_size(both[n:], sources.shape[-1])
        feats, served = space.embed(samples)
        ranks = reencoded_ranks(feats, chosen, space.feats)
        small = to_size(samples, sources.shape[-1])
        pixel_ranks = reencoded_ranks(pixel_vectors(small), chosen, self.gallery_pixels)
        judged = feats if space is self.main else self.main.embed(samples)[0]  # the class in the main space
        hits = {"classifier": int(np.sum(self.classifier.predict(judged) == labels)),
                "pixel_judge": int(np.sum(self.judge.predict(small) == labels))}
        pairs = np.stack([small[:k], again], axis=1)
        row: dict = {"ratio": ratio, "guidance": guidance, "images": n, "feature": space.encoder.feature,
                     "median_rank": float(np.median(ranks)), "r_at_1": recall_at(ranks, 1),
                     "r_at_10": recall_at(ranks, 10),
                     "condition_median_rank": float(np.median(reencoded_ranks(cond_np, chosen, space.feats))),
                     "pixel_median_rank": float(np.median(pixel_ranks)), "pixel_r_at_1": recall_at(pixel_ranks, 1),
                     "pixel_r_at_10": recall_at(pixel_ranks, 10),
                     "seed_spread": seed_spread(pairs, self.pair_distance), "spread": seed_spread(pairs, 1.0),
                     "spread_images": k, "sharpness_ratio": sharpness_ratio(small, sources),
                     "kid": kid(feats, space.feats[self.others])}
        if space is self.main:  # what the masked feature itself tells: a decoder can keep at most this much class
            row["classifier_on_condition"] = float(np.mean(self.classifier.predict(cond_np) == labels))
        if served is not None:  # the same samples ranked by the bundle's served feature (the same forward pass)
            row["served_feature"] = space.encoder.served
            row["served_median_rank"] = float(np.median(reencoded_ranks(served, chosen, space.served)))
        for judge, hit in hits.items():
            low, high = wilson(hit, n)
            row[judge] = {"consistency": hit / n, "ci95": [round(low, 4), round(high, 4)],
                          "of_originals": hit / n / max(self.ceilings[judge], 1e-12)}
        row["seconds"] = round(time.perf_counter() - started, 1)
        return row, samples


def app_seconds(pipe: RCDMPipeline, image: torch.Tensor, guidance: float | None = None, repeats: int = 3) -> float:
    """Wall time of the app's request: 8 samples of one uint8 image, unmasked, default steps, at ``guidance`` (the
    decoder's default when None); the median of ``repeats``."""
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        pipe.sample(image, None, num_samples=8, seed=r, guidance_scale=guidance)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def app_timings(pipe: RCDMPipeline, image: torch.Tensor, repeats: int) -> dict:
    """``app_8_samples_s`` (the decoder's default guidance) and the same by guidance scale."""
    default = round(app_seconds(pipe, image, None, repeats), 3)
    scales = GUIDANCE if pipe.guidance_trained else ()
    by = {f"{g:g}": default if g == pipe.guidance() else round(app_seconds(pipe, image, g, repeats), 3)
          for g in scales}
    return {"app_8_samples_s": default, "app_8_samples_s_by_guidance": by or {"1": default}}


def _reference(harness: Harness, name: str, run_dir: Path, bundle: Path | None, ratios: tuple[float, ...]) -> dict:
    """A reference decoder measured on the same images, masks and seeds: its sweep at its own default guidance,
    ranks in its own conditioning space, classes by the main classifier and the pixel judge."""
    from visualizer.pipeline import RCDMPipeline, load_run

    if bundle is None:  # the bundle the reference trained on, as its checkpoint records it
        bundle = Path(load_run(run_dir)["bundle"]["path"])
    pipe = RCDMPipeline.from_dirs(bundle, run_dir, name=name)
    space = harness.main if pipe.encoder.model_id == harness.pipe.encoder.model_id and \
        pipe.encoder.feature == harness.pipe.encoder.feature else Space(pipe.encoder, harness.gallery_images)
    rows = []
    for ratio in ratios:
        row, _ = harness.measure(ratio, pipe.guidance(), pipe=pipe, space=space)
        rows.append(row)
        print(f"{name}: {_line(row)}", flush=True)
    return {"decoder": str(run_dir), "bundle": pipe.encoder.model_id, "bundle_path": str(bundle),
            "decoder_step": pipe.step, "kind": pipe.kind, "feature": pipe.encoder.feature, "rows": rows}


def targets(out: dict) -> dict:
    """The issue's targets, each with the measured value and whether it is met (None: not measured here)."""
    rows = {r["ratio"]: r for r in out["rows"] if r.get("sweep")}
    plain, masked = rows.get(0.0), rows.get(0.7)
    random_init = {r["ratio"]: r for r in out.get("references", {}).get("random_init", {}).get("rows", [])}.get(0.0)

    def check(value, met, target: str) -> dict:
        return {"value": value, "met": None if value is None else bool(met), "target": target}

    found: dict = {}
    if plain is not None:
        found["median_rank_unmasked"] = check(plain["median_rank"], plain["median_rank"] <= 50,
                                              f"<= 50 of {out['gallery']:,}, in the {plain['feature']} space")
        found["r_at_10_unmasked"] = check(plain["r_at_10"], plain["r_at_10"] >= 0.25, ">= 0.25")
        found["seed_spread_unmasked"] = check(plain["seed_spread"], plain["seed_spread"] >= 0.4, ">= 0.4")
        found["class_kept_classifier"] = check(plain["classifier"]["of_originals"],
                                               plain["classifier"]["of_originals"] >= 0.9,
                                               ">= 0.9 of the classifier's accuracy on the originals")
        found["class_kept_pixel_judge"] = check(plain["pixel_judge"]["consistency"],
                                                plain["pixel_judge"]["consistency"] >= 0.6, ">= 0.6")
        if random_init is not None:
            for judge in ("classifier", "pixel_judge"):
                ours, theirs = plain[judge]["consistency"], random_init[judge]["consistency"]
                found[f"{judge}_above_random_init"] = check(ours, ours > theirs, f"> the random-init decoder's "
                                                                                 f"{theirs:.3f}")
    if plain is not None and masked is not None:
        found["seed_spread_grows_at_0.7"] = check(masked["seed_spread"], masked["seed_spread"] > plain["seed_spread"],
                                                  f"> unmasked {plain['seed_spread']:.3f}")
        own = masked["condition_median_rank"]
        found["rank_at_0.7_vs_condition"] = check(masked["median_rank"], masked["median_rank"] <= 2 * own,
                                                  f"<= 2 x the masked condition's own {own:g}")
    if "app_8_samples_s" in out:
        found["app_8_samples_s"] = check(out["app_8_samples_s"], out["app_8_samples_s"] <= 1.5, "<= 1.5 s")
    return found


def run(args: argparse.Namespace) -> dict:
    from visualizer.pipeline import RCDMPipeline
    from visualizer.render import save_grid, to_hwc

    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (QUICK if args.quick else FULL)[key]
             for key in FULL}
    ratios = tuple(args.ratios) if args.ratios else (RATIOS[:2] if args.quick else RATIOS)
    pipe = RCDMPipeline.from_dirs(args.bundle, args.decoder, name=args.tag)
    torch.manual_seed(args.seed)
    harness = Harness(pipe, sizes, args.seed, args.steps)
    sweep = pipe.guidance()  # the app's default
    out: dict = {"benchmark": "decoder_harness", "tag": args.tag, "bundle": pipe.encoder.model_id,
                 "decoder": str(args.decoder), "decoder_step": pipe.step, "quick": args.quick, "sizes": sizes,
                 "kind": pipe.kind, "feature": pipe.encoder.feature, "served_feature": pipe.encoder.served,
                 "config": {"sampler": pipe.config.diffusion.sampler,
                            "sample_steps": pipe.config.diffusion.sample_steps,
                            "image_size": pipe.image_size, "guidance_trained": pipe.guidance_trained,
                            "guidance": sweep, "measured_steps": args.steps or pipe.config.diffusion.sample_steps},
                 "ceilings": harness.ceilings, "kid_real_vs_real": harness.kid_floor,
                 "seed_spread_unit": harness.pair_distance, "gallery": len(harness.gallery_images), "rows": []}
    grid_rows: list = []
    for ratio in ratios:
        row, samples = harness.measure(ratio, sweep)
        row["sweep"] = True
        out["rows"].append(row)
        print(_line(row), flush=True)
        for n in range(min(8, len(samples))):
            if len(grid_rows) <= n:
                grid_rows.append([to_hwc(rgb(harness.sources[n:n + 1])[0])])
            grid_rows[n].append(to_hwc(samples[n]))
    if pipe.guidance_trained:
        for scale in args.guidance if args.guidance is not None else (GUIDANCE[1:2] if args.quick else GUIDANCE):
            if scale != sweep or 0.0 not in ratios:
                row, _ = harness.measure(0.0, scale, images=sizes["guidance_images"])
                out["rows"].append(row)
                print(_line(row), flush=True)
    references = {}
    if args.random_init is not None:
        references["random_init"] = _reference(harness, "random_init", args.random_init, args.random_init_bundle,
                                               ratios)
    if args.regression is not None:
        references["regression"] = _reference(harness, "regression", args.regression, args.bundle, ratios)
    if references:
        out["references"] = references
    out.update(app_timings(pipe, rgb(harness.sources[:1]), sizes["timing_repeats"]))
    print(f"8 samples at the app's defaults: {out['app_8_samples_s']:.2f} s; by guidance: "
          f"{out['app_8_samples_s_by_guidance']}", flush=True)
    out["targets"] = targets(out)
    for name, t in out["targets"].items():
        print(f"target {name}: {t['value']} ({t['target']}): {'met' if t['met'] else 'NOT met'}", flush=True)
    path = args.out or RESULTS / f"decoder_harness-{args.tag}.json"
    grid = save_grid(grid_rows, path.with_suffix(".png"), cell=max(56, pipe.image_size))
    out.update(grid=grid.name, grid_columns=f"original, then one sample at mask ratios {', '.join(map(str, ratios))}",
               machine=machine(), threads=torch.get_num_threads())
    save_json(path, out)
    return out


def retime(args: argparse.Namespace) -> None:
    """The timings of ``--out`` (or decoder_harness-TAG.json) measured again, the figures left as they are."""
    from visualizer.pipeline import RCDMPipeline

    path = args.out or RESULTS / f"decoder_harness-{args.tag}.json"
    out = json.loads(path.read_text())
    pipe = RCDMPipeline.from_dirs(args.bundle, args.decoder, name=args.tag)
    out.update(app_timings(pipe, rgb(FashionMNIST(split="test").images[:1]), 3), timing_machine=machine())
    save_json(path, out)
    print(f"8 samples at the app's defaults: {out['app_8_samples_s']:.2f} s; by guidance: "
          f"{out['app_8_samples_s_by_guidance']}", flush=True)


def _line(row: dict) -> str:
    return (f"ratio {row['ratio']:.1f} guidance {row['guidance']:g}: median rank {row['median_rank']:.0f} "
            f"(condition {row['condition_median_rank']:.0f}, pixels {row['pixel_median_rank']:.0f}), "
            f"R@1 {row['r_at_1']:.3f}, R@10 {row['r_at_10']:.3f}; consistency classifier "
            f"{row['classifier']['consistency']:.3f} pixels {row['pixel_judge']['consistency']:.3f}; seed spread "
            f"{row['seed_spread']:.3f}; sharpness {row['sharpness_ratio']:.2f}; KID {row['kid']:.4f}; "
            f"{row['seconds']} s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--decoder", type=Path, required=True, help="a decoder run (msn-visualize train's output)")
    ap.add_argument("--tag", default="demo", help="names the results file: decoder_harness-TAG.json")
    ap.add_argument("--random-init", type=Path, metavar="RUN",
                    help="reference: a decoder trained the same way on the bundle's random-init twin")
    ap.add_argument("--random-init-bundle", type=Path, metavar="BUNDLE",
                    help="the twin bundle (default: the one the --random-init run's checkpoint records)")
    ap.add_argument("--regression", type=Path, metavar="RUN",
                    help="reference: a regression decoder (model.kind=regression) on the same bundle and feature")
    sizes = ap.add_argument_group("sizes (defaults: the full measurement; --quick: a smoke run)")
    for key, help_ in (("images", "class-balanced test images, one sample each"),
                       ("gallery", "test images the source is ranked among"),
                       ("labelled_per_class", "labelled training images per class for the feature classifier"),
                       ("judge_bank", "training images of the pixel judge"),
                       ("kid_images", "other test images for KID"),
                       ("spread_images", "images with a second sample for the seed spread"),
                       ("pairs", "random test-image pairs: the seed spread's unit"),
                       ("guidance_images", "images of the unmasked rows by guidance scale"),
                       ("timing_repeats", "repeats of the app timing")):
        sizes.add_argument(f"--{key.replace('_', '-')}", type=int,
                           help=f"{help_} (default {FULL[key]:,}; quick {QUICK[key]:,})")
    ap.add_argument("--ratios", type=float, nargs="+", help=f"mask ratios (default {' '.join(map(str, RATIOS))})")
    ap.add_argument("--guidance", type=float, nargs="*", help="unmasked rows at these guidance scales (default "
                                                               f"{' '.join(map(str, GUIDANCE))}; none: no rows)")
    ap.add_argument("--steps", type=int, help="sampling steps of the measured rows (default: each decoder's own; "
                                              "the app timing always uses its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="small everything: checks the harness, not the decoder")
    ap.add_argument("--timing-only", action="store_true",
                    help="measure the app's timings again (the machine alone) into the existing results file")
    args = ap.parse_args(argv)
    if args.timing_only:
        retime(args)
        return
    run(args)


if __name__ == "__main__":
    main()
