"""A decoder measured as RCDM's paper measures it: faithfulness, class kept, sharpness, realism, masking, guidance.

    python -m benchmarks.evaluation.decoder_harness --bundle bundles/demo --decoder runs/demo-rcdm --tag demo
    python -m benchmarks.evaluation.decoder_harness --bundle B --decoder D --quick      # a smoke run, a minute

On Fashion-MNIST: ``--images`` class-balanced test images (500) condition one sample each, at mask ratios 0, 0.5,
0.7 and 0.9 (the keep rows seeded per image), with the decoder's own sampler at guidance 1 (the app's default), and
at guidance 2 and 3 unmasked (the first ``--guidance-images``, 200) when the decoder learned an unconditional
branch. Per setting
(:mod:`visualizer.measures` defines each figure):

- faithfulness: each sample re-encoded and its conditioning image ranked among the 10,000 test images (median rank,
  R@1, R@10; a decoder that keeps only the class ranks near 500, a random one 5,000);
- class kept: the feature classifier's consistency (a low-shot logistic regression on 100 labelled training
  images per class), with its 95 % interval and as a fraction of the classifier's accuracy on the originals; and
  the pixel judge's (weighted kNN-10 on raw pixels against the 60,000 training images), likewise;
- sharpness: sample against source high-frequency energy, paired (1 = as sharp);
- realism: KID in the encoder's feature space against 2,000 other test images, beside real against real;
- spread: mean pairwise pixel distance of 4 samples for each of 25 images.

Then the wall time of 8 samples of one image at the app's default settings. Writes
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
    recall_at,
    reencoded_ranks,
    sharpness_ratio,
    spread,
    wilson,
)
from visualizer.quality import balanced

if TYPE_CHECKING:
    from visualizer.pipeline import RCDMPipeline

RATIOS = (0.0, 0.5, 0.7, 0.9)
GUIDANCE = (2.0, 3.0)


def rgb(images: np.ndarray) -> torch.Tensor:
    """Grey uint8 (N, H, W) -> uint8 (N, 3, H, W), as the decoder's data and the service see them."""
    return torch.tensor(images, dtype=torch.uint8).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def to_size(samples: torch.Tensor, size: int) -> np.ndarray:
    """uint8 (N, 3, S, S) samples -> grey uint8 (N, size, size) (antialiased bicubic, as the encoder resizes)."""
    grey = samples.float().mean(dim=1, keepdim=True)
    if grey.shape[-1] != size:
        grey = F.interpolate(grey, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return grey.clamp(0, 255).round().to(torch.uint8)[:, 0].numpy()


class Harness:
    """The fixed parts of a measurement: data, gallery, judges, the images that condition."""

    def __init__(self, pipe: RCDMPipeline, images: int, seed: int, quick: bool):
        self.pipe, self.seed = pipe, seed
        train, test = FashionMNIST(split="train"), FashionMNIST(split="test")
        rng = np.random.default_rng(seed)
        n_gallery = 1000 if quick else len(test)
        self.gallery_images, self.gallery_labels = test.images[:n_gallery], test.labels[:n_gallery]
        self.chosen = balanced(self.gallery_labels, -(-images // 10), rng, np.array([], dtype=np.int64))[:images]
        self.others = rng.permutation(np.setdiff1d(np.arange(n_gallery), self.chosen))[: 300 if quick else 2000]
        self.gallery_feats = self.embed(rgb(self.gallery_images))
        labelled = balanced(train.labels, 20 if quick else 100, rng, np.array([], dtype=np.int64))
        self.classifier = fit_logistic(self.embed(rgb(train.images[labelled])), train.labels[labelled])
        bank = np.arange(len(train)) if not quick else rng.permutation(len(train))[:5000]
        self.judge = PixelJudge(train.images[bank], train.labels[bank])
        self.labels = self.gallery_labels[self.chosen]
        self.sources = self.gallery_images[self.chosen]
        feats = self.gallery_feats[self.chosen]
        self.ceilings = {"classifier": float(np.mean(self.classifier.predict(feats) == self.labels)),
                         "pixel_judge": float(np.mean(self.judge.predict(self.sources) == self.labels))}
        half = len(self.others) // 2
        self.kid_floor = kid(self.gallery_feats[self.others[:half]], self.gallery_feats[self.others[half:]])

    def embed(self, images_uint8: torch.Tensor, keep: torch.Tensor | None = None) -> np.ndarray:
        enc = self.pipe.encoder
        out = [enc.embed(images_uint8[i:i + 256], None if keep is None else keep[i:i + 256])
               for i in range(0, len(images_uint8), 256)]
        return torch.cat(out).cpu().numpy()

    def keep_rows(self, ratio: float, count: int, salt: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + round(ratio * 100) + salt)
        return random_keep_idx(count, self.pipe.encoder.num_patches, ratio, shared=False, generator=generator)

    def samples(self, cond: torch.Tensor, guidance: float, seed: int) -> torch.Tensor:
        return torch.cat([self.pipe.sample_from_features(chunk, guidance_scale=guidance, seed=seed + i)
                          for i, chunk in enumerate(cond.split(128))])

    def measure(self, ratio: float, guidance: float, images: int | None = None) -> tuple[dict, torch.Tensor]:
        """One sample for each of the first ``images`` chosen images (all by default; the order is class-balanced)
        at ``ratio`` and ``guidance``: every figure of the module docstring."""
        started = time.perf_counter()
        n = min(images or len(self.chosen), len(self.chosen))
        chosen, sources, labels = self.chosen[:n], self.sources[:n], self.labels[:n]
        keep = self.keep_rows(ratio, n)
        cond = torch.from_numpy(self.embed(rgb(sources), keep))
        samples = self.samples(cond, guidance, seed=self.seed)
        feats = self.embed(samples)
        ranks = reencoded_ranks(feats, chosen, self.gallery_feats)
        small = to_size(samples, sources.shape[-1])
        hits = {"classifier": int(np.sum(self.classifier.predict(feats) == labels)),
                "pixel_judge": int(np.sum(self.judge.predict(small) == labels))}
        # what the masked feature itself tells: the classifier on the conditioning features (a decoder can keep
        # at most this much of the class)
        feature_ceiling = float(np.mean(self.classifier.predict(cond.numpy()) == labels))
        row: dict = {"ratio": ratio, "guidance": guidance, "images": n,
                     "median_rank": float(np.median(ranks)), "r_at_1": recall_at(ranks, 1),
                     "r_at_10": recall_at(ranks, 10), "sharpness_ratio": sharpness_ratio(small, sources),
                     "kid": kid(feats, self.gallery_feats[self.others]), "classifier_on_condition": feature_ceiling}
        for judge, hit in hits.items():
            low, high = wilson(hit, n)
            row[judge] = {"consistency": hit / n, "ci95": [round(low, 4), round(high, 4)],
                          "of_originals": hit / n / max(self.ceilings[judge], 1e-12)}
        row["seconds"] = round(time.perf_counter() - started, 1)
        return row, samples

    def spread_at(self, ratio: float, images: int = 50, per_image: int = 4) -> float:
        idx = self.chosen[:images]
        keep = self.keep_rows(ratio, len(idx), salt=7)
        cond = torch.from_numpy(self.embed(rgb(self.gallery_images[idx]), keep))
        samples = self.samples(cond.repeat_interleave(per_image, dim=0), 1.0, seed=self.seed + 1)
        small = to_size(samples, self.sources.shape[-1]).reshape(len(idx), per_image, *self.sources.shape[1:])
        return float(np.mean([spread(s) for s in small]))


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
    scales = (1.0, *GUIDANCE) if pipe.guidance_trained else (1.0,)
    return {"app_8_samples_s": round(app_seconds(pipe, image, None, repeats), 3),
            "app_8_samples_s_by_guidance": {f"{g:g}": round(app_seconds(pipe, image, g, repeats), 3) for g in scales}}


def run(args: argparse.Namespace) -> dict:
    from visualizer.pipeline import RCDMPipeline
    from visualizer.render import save_grid, to_hwc

    pipe = RCDMPipeline.from_dirs(args.bundle, args.decoder, name=args.tag)
    torch.manual_seed(args.seed)
    harness = Harness(pipe, args.images, args.seed, args.quick)
    out: dict = {"benchmark": "decoder_harness", "tag": args.tag, "bundle": pipe.encoder.model_id,
                 "decoder": str(args.decoder), "decoder_step": pipe.step, "quick": args.quick,
                 "config": {"sampler": pipe.config.diffusion.sampler,
                            "sample_steps": pipe.config.diffusion.sample_steps,
                            "image_size": pipe.image_size, "guidance_trained": pipe.guidance_trained},
                 "ceilings": harness.ceilings, "kid_real_vs_real": harness.kid_floor,
                 "gallery": len(harness.gallery_images), "rows": []}
    grid_rows: list = []
    ratios = RATIOS[:2] if args.quick else RATIOS
    for ratio in ratios:
        row, samples = harness.measure(ratio, 1.0)
        row["spread"] = harness.spread_at(ratio, images=10 if args.quick else 25)
        out["rows"].append(row)
        print(_line(row), flush=True)
        for n in range(8):
            if len(grid_rows) <= n:
                grid_rows.append([to_hwc(rgb(harness.sources[n:n + 1])[0])])
            grid_rows[n].append(to_hwc(samples[n]))
    if pipe.guidance_trained:
        for scale in GUIDANCE[:1] if args.quick else GUIDANCE:
            row, _ = harness.measure(0.0, scale, images=args.guidance_images)
            out["rows"].append(row)
            print(_line(row), flush=True)
    out.update(app_timings(pipe, rgb(harness.sources[:1]), 1 if args.quick else 3))
    print(f"8 samples at the app's defaults: {out['app_8_samples_s']:.2f} s; by guidance: "
          f"{out['app_8_samples_s_by_guidance']}", flush=True)
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
    return (f"ratio {row['ratio']:.1f} guidance {row['guidance']:g}: median rank {row['median_rank']:.0f}, "
            f"R@1 {row['r_at_1']:.3f}, R@10 {row['r_at_10']:.3f}; consistency classifier "
            f"{row['classifier']['consistency']:.3f} pixels {row['pixel_judge']['consistency']:.3f}; sharpness "
            f"{row['sharpness_ratio']:.2f}; KID {row['kid']:.4f}; {row['seconds']} s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--decoder", type=Path, required=True, help="a decoder run (msn-visualize train's output)")
    ap.add_argument("--tag", default="demo", help="names the results file: decoder_harness-TAG.json")
    ap.add_argument("--images", type=int, default=500, help="class-balanced test images, one sample each")
    ap.add_argument("--guidance-images", type=int, default=200, help="images of the guidance 2 and 3 rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="small everything: checks the harness, not the decoder")
    ap.add_argument("--timing-only", action="store_true",
                    help="measure the app's timings again (the machine alone) into the existing results file")
    args = ap.parse_args(argv)
    if args.timing_only:
        retime(args)
        return
    if args.quick:
        args.images = min(args.images, 40)
    run(args)


if __name__ == "__main__":
    main()
