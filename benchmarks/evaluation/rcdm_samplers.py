"""Which sampler should a small RCDM decoder use? Class consistency and sample roughness per sampler and step count.

    python -m benchmarks.evaluation.rcdm_samplers --bundle bundles/demo --decoder runs/rcdm_eval/msn

For ``--images`` class-balanced test images (``--samples`` samples each, unmasked conditioning) and every
``SAMPLER:STEPS`` in ``--settings``, prints and writes to ``--out`` (JSON): the fraction of samples whose class, by
``rcdm_eval.py``'s low-shot classifier on MSN features, equals the conditioning image's; the mean absolute vertical
neighbour difference of the samples in grey levels (high-frequency noise left in a sample raises it); seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REPO, machine, save_json
from benchmarks.evaluation.rcdm_eval import balanced_indices, images_of
from training.data import build_dataset
from training.evaluation.lowshot import fit_logistic


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--decoder", type=Path, required=True)
    parser.add_argument("--settings", nargs="+", default=["ddim:50", "ddim:250", "ddpm:50", "ddpm:100", "ddpm:250"])
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "rcdm_samplers.json")
    args = parser.parse_args(argv)
    from visualizer.pipeline import RCDMPipeline  # diffusers: after parsing, so a bad flag fails in a blink

    pipe = RCDMPipeline.from_dirs(args.bundle, args.decoder)
    load_size = int(pipe.encoder.transform["resize"])
    train = build_dataset("fashion-mnist", root=None, split="train", load_size=load_size)
    test = build_dataset("fashion-mnist", root=None, split="test", load_size=load_size)
    rng = np.random.default_rng(args.seed)
    fit_idx = balanced_indices(np.asarray(train.labels), args.train_per_class, rng)
    classifier = fit_logistic(pipe.encoder.embed(images_of(train, fit_idx)).numpy(), np.asarray(train.labels)[fit_idx])
    idx = balanced_indices(np.asarray(test.labels), max(1, args.images // 10), rng)[: args.images]
    labels = np.repeat(np.asarray(test.labels)[idx], args.samples)
    feat = pipe.encoder.embed(images_of(test, idx)).repeat_interleave(args.samples, dim=0)

    rows = []
    for setting in args.settings:
        sampler, steps = setting.split(":")
        start = time.perf_counter()
        samples = pipe.sample_from_features(feat, steps=int(steps), sampler=sampler, seed=args.seed)
        seconds = time.perf_counter() - start
        predicted = classifier.predict(pipe.encoder.embed(samples).numpy())
        grey = samples.float()[:, 0]
        rows.append({"sampler": sampler, "steps": int(steps), "consistent": float(np.mean(predicted == labels)),
                     "roughness": float((grey[:, 1:] - grey[:, :-1]).abs().mean()), "seconds": round(seconds, 1)})
        print(f"{sampler} {steps:>4} steps: consistency {rows[-1]['consistent']:.3f}, "
              f"roughness {rows[-1]['roughness']:.1f}, {seconds:.0f} s", flush=True)
    save_json(args.out, {"bundle": pipe.encoder.model_id, "decoder": str(args.decoder),
                                 "decoder_steps": pipe.step, "images": len(idx), "samples_per_image": args.samples,
                                 "machine": machine(), "threads": torch.get_num_threads(), "results": rows})


if __name__ == "__main__":
    main()
