"""What a decoder's samples keep of their conditioning image, measured as RCDM's paper measures it, and more.

- **Faithfulness** (RCDM, Bordes et al. 2022, section 4): each sample is encoded again with the same encoder and
  its conditioning image is ranked among a gallery of real images by cosine similarity: rank 1 means the sample is
  closer to its own source than to any other image (:func:`reencoded_ranks`; median rank, R@1, R@10).
- **Class kept**: a judge that does not use the encoder, k nearest neighbours on raw pixels against the training
  images (:class:`PixelJudge`), beside the feature classifier of :mod:`visualizer.quality`; both with a Wilson
  interval (:func:`wilson`).
- **Sharpness**: high-frequency energy (the mean squared response of a 3 x 3 Laplacian) of each sample against its
  own conditioning image, so classes cancel; a blurry class average scores well below 1 (:func:`sharpness_ratio`).
- **Realism**: KID (Binkowski et al. 2018), the unbiased squared MMD with the cubic polynomial kernel, in the
  encoder's feature space, averaged over subsets (:func:`kid`); real against real gives its floor.
- **Spread**: the mean pairwise distance between samples of one image (:func:`spread`): what the representation
  leaves free should grow with the mask. As a fraction of the distance between two random images
  (:func:`random_pair_distance`), the *seed spread* (:func:`seed_spread`): 0 for a decoder that ignores its seed (a
  regression decoder, or one that reproduces its source), near 1 for one that ignores its condition.
- **Faithfulness in pixels**: the same rank with raw pixels instead of a feature (:func:`pixel_vectors`, mean-centred
  grey images, cosine): a sample that ranks its source first here reproduces the image.

Every function takes arrays (numpy or torch) and returns plain numbers, so the app's header, the end-of-training
figure and ``benchmarks/evaluation/decoder_harness.py`` show the same quantities.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["PixelJudge", "kid", "pixel_vectors", "random_pair_distance", "recall_at", "reencoded_ranks", "seed_spread",
           "sharpness", "sharpness_ratio", "spread", "wilson"]


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def reencoded_ranks(sample_feats: np.ndarray, source_index: np.ndarray, gallery_feats: np.ndarray) -> np.ndarray:
    """1-based rank of each sample's source (row ``source_index[i]`` of the gallery) among all gallery images,
    by cosine similarity to the sample's features; ties count against the source."""
    sims = _unit(sample_feats) @ _unit(gallery_feats).T
    own = sims[np.arange(len(sims)), np.asarray(source_index)]
    return (sims >= own[:, None]).sum(axis=1).astype(np.int64)


def recall_at(ranks: np.ndarray, k: int) -> float:
    return float(np.mean(np.asarray(ranks) <= k))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion: right near 0 and 1, where the normal one is not."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


class PixelJudge:
    """Weighted k-nearest-neighbour vote on raw pixels (grey, the judge's ``size``), cosine on mean-centred
    images: a class judge that shares nothing with the encoder."""

    def __init__(self, train_images: np.ndarray, train_labels: np.ndarray, k: int = 10):
        self.size = train_images.shape[-1]
        self.bank = _unit(self._flat(train_images)).astype(np.float32)
        self.labels, self.k = np.asarray(train_labels), k
        self.classes = np.unique(self.labels)

    def _flat(self, images: np.ndarray) -> np.ndarray:
        x = np.asarray(images, dtype=np.float32)
        if x.ndim == 4:  # (N, C, H, W): grey
            x = x.mean(axis=1)
        x = x.reshape(len(x), -1)
        return x - x.mean(axis=1, keepdims=True)

    def predict(self, images: np.ndarray, batch: int = 512) -> np.ndarray:
        """Labels of uint8 or float images ``(N, [C,] size, size)`` (resize them to the judge's size first)."""
        out = []
        for start in range(0, len(images), batch):
            q = _unit(self._flat(images[start: start + batch])).astype(np.float32)
            sims = q @ self.bank.T
            top = np.argpartition(-sims, self.k, axis=1)[:, : self.k]
            votes = np.zeros((len(q), len(self.classes)))
            index = np.searchsorted(self.classes, self.labels[top])
            np.add.at(votes, (np.arange(len(q))[:, None], index), np.take_along_axis(sims, top, axis=1))
            out.append(self.classes[votes.argmax(axis=1)])
        return np.concatenate(out) if out else np.array([], dtype=self.labels.dtype)


def sharpness(images: np.ndarray) -> np.ndarray:
    """Per image: mean squared 3 x 3 Laplacian of the grey image in [0, 1] (interior pixels)."""
    x = np.asarray(images, dtype=np.float64)
    x = x.mean(axis=1) if x.ndim == 4 else x
    x = x / 255.0 if x.max(initial=0) > 1.0 else x
    lap = (x[:, :-2, 1:-1] + x[:, 2:, 1:-1] + x[:, 1:-1, :-2] + x[:, 1:-1, 2:] - 4 * x[:, 1:-1, 1:-1])
    return (lap ** 2).mean(axis=(1, 2))


def sharpness_ratio(samples: np.ndarray, sources: np.ndarray) -> float:
    """Geometric mean over pairs of sample / source high-frequency energy (1: as sharp as the originals)."""
    a, b = sharpness(samples), sharpness(sources)
    keep = (a > 0) & (b > 0)
    return float(np.exp(np.mean(np.log(a[keep] / b[keep])))) if keep.any() else float("nan")


def kid(x: np.ndarray, y: np.ndarray, *, subsets: int = 20, subset_size: int = 200, seed: int = 0) -> float:
    """Kernel inception distance of two feature sets (unbiased MMD², kernel (x.y / d + 1)³), subset mean."""
    rng = np.random.default_rng(seed)
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    m = min(subset_size, len(x), len(y))
    d = x.shape[1]
    values = []
    for _ in range(subsets):
        a, b = x[rng.choice(len(x), m, replace=False)], y[rng.choice(len(y), m, replace=False)]
        kxx, kyy, kxy = (a @ a.T / d + 1) ** 3, (b @ b.T / d + 1) ** 3, (a @ b.T / d + 1) ** 3
        values.append((kxx.sum() - np.trace(kxx)) / (m * (m - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
                      - 2 * kxy.mean())
    return float(np.mean(values))


def spread(samples: np.ndarray) -> float:
    """Mean pairwise RMS pixel distance (in [0, 1] units) between the samples of one image ``(S, [C,] H, W)``."""
    x = np.asarray(samples, dtype=np.float64)
    x = (x / 255.0 if x.max(initial=0) > 1.0 else x).reshape(len(x), -1)
    if len(x) < 2:
        return 0.0
    diffs = [np.sqrt(np.mean((x[i] - x[j]) ** 2)) for i in range(len(x)) for j in range(i + 1, len(x))]
    return float(np.mean(diffs))


def _unit_pixels(images: np.ndarray) -> np.ndarray:
    """(N, [C,] H, W) uint8 (0-255) or float ([0, 1]) images -> (N, H*W) grey values in [0, 1]."""
    x = np.asarray(images, dtype=np.float64)
    x = (x / 255.0 if x.max(initial=0) > 1.0 else x)
    x = x.mean(axis=1) if x.ndim == 4 else x
    return x.reshape(len(x), -1)


def pixel_vectors(images: np.ndarray) -> np.ndarray:
    """Mean-centred grey pixels per image, ``(N, H*W)`` float32: the space of :class:`PixelJudge` and of the pixel
    rank (``reencoded_ranks(pixel_vectors(samples), index, pixel_vectors(gallery))``)."""
    x = _unit_pixels(images)
    return (x - x.mean(axis=1, keepdims=True)).astype(np.float32)


def random_pair_distance(images: np.ndarray, pairs: int = 2000, seed: int = 0) -> float:
    """Mean RMS pixel distance (in [0, 1] units, as :func:`spread`) between ``pairs`` random pairs of two different
    images of ``images`` ``(N, [C,] H, W)``: the unit of the seed spread."""
    x = _unit_pixels(images)
    if len(x) < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    i = rng.integers(len(x), size=pairs)
    j = (i + rng.integers(1, len(x), size=pairs)) % len(x)
    return float(np.mean(np.sqrt(np.mean((x[i] - x[j]) ** 2, axis=1))))


def seed_spread(samples: np.ndarray, reference: float) -> float:
    """Mean over conditions of the mean pairwise RMS distance between the samples of one condition, ``samples``
    ``(conditions, samples, [C,] H, W)``, as a fraction of ``reference`` (:func:`random_pair_distance`)."""
    return float(np.mean([spread(s) for s in np.asarray(samples)]) / max(reference, 1e-12))
