"""Which items to label: cold-start selection and uncertainty + diversity suggestions (numpy + FAISS k-means).

Both run in the classifier's own space (row centring + L2, :func:`msn_core.lowshot.center_and_normalize`), so
"diverse" means diverse for the model that will be fitted. Everything is deterministic for a seed: the candidate
sample, FAISS k-means (seeded; trained on every candidate so no internal subsample varies) and every tie-break.

Cold start (``select``), measured by ``benchmarks/evaluation/label_efficiency.py``:

- ``typical`` (default): k-means into ``n`` clusters (plus one per already-labelled item, whose clusters are
  skipped), then in each of the largest uncovered clusters the most *typical* member, the one with the highest
  density (inverse mean distance to its nearest neighbours in the cluster). Centroid-nearest items can sit between
  modes; dense ones are where a class's mass is (TypiClust, Hacohen et al. 2022, re-derived here).
- ``kmeans``: the item nearest each k-means centroid.  ``kcenter``: greedy farthest-first traversal (diverse,
  but it favours outliers).  ``random``: uniform, the baseline.

Suggestions (``suggest``) rank unlabelled items by uncertainty (``margin``: 1 - (p1 - p2), or ``entropy``) and keep
them diverse: the most uncertain ``POOL_FACTOR * n`` candidates are clustered into ``n`` groups and the most
uncertain member of each group is taken, so 20 suggestions are never 20 near-duplicates. ``typical`` continues the
cold-start selector with the labelled items as covered clusters (no classifier needed); ``random`` is the baseline.
"""
from __future__ import annotations

import faiss
import numpy as np

SELECT_STRATEGIES: tuple[str, ...] = ("typical", "kmeans", "kcenter", "random")
SUGGEST_STRATEGIES: tuple[str, ...] = ("margin", "entropy", "typical", "random")
KNN = 20  # neighbours for the typicality estimate (TypiClust's choice)
DENSITY_ROWS, DENSITY_REFS = 200, 400  # typicality: rows scored per cluster, reference rows (cost is their product)
NITER, KMEANS_POINTS = 20, 256  # k-means iterations; training rows per centroid (FAISS' default sample)
POOL_FACTOR = 5  # suggest: the most uncertain POOL_FACTOR * n candidates are clustered into n groups


def candidate_positions(total: int, limit: int, seed: int, exclude=()) -> np.ndarray:
    """Sorted positions in ``range(total)`` minus ``exclude``: all of them, or a seeded sample of ``limit`` (what
    keeps select/suggest within their latency at 100k+ items; k-means needs a sample, not the whole pool)."""
    keep = np.ones(total, dtype=bool)
    keep[np.asarray(list(exclude), dtype=np.int64)] = False
    pos = np.flatnonzero(keep)
    if len(pos) > limit:
        pos = np.sort(np.random.default_rng(seed).choice(pos, limit, replace=False))
    return pos


def as_space(vecs: np.ndarray) -> np.ndarray:
    """Float32 rows in the classifier's space (centred, unit length), C-contiguous for FAISS. The low-shot
    classifier's own normalisation leaves these rows unchanged, so they can be fitted and scored as they are."""
    x = np.array(vecs, dtype=np.float32, order="C", copy=True)
    x -= x.mean(axis=1, keepdims=True)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x


def kmeans_assign(x: np.ndarray, k: int, seed: int, niter: int = NITER) -> tuple[np.ndarray, np.ndarray]:
    """``(centroids (k, d), assignment (n,))`` from seeded FAISS k-means (trained on a seeded sample of at most
    ``KMEANS_POINTS`` rows per centroid, then every row assigned); ``k`` is capped at ``len(x)``."""
    k = max(1, min(int(k), len(x)))
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=int(seed) & 0x7FFFFFFF, spherical=True,
                      max_points_per_centroid=KMEANS_POINTS, verbose=False)
    km.train(x)
    _, assign = km.index.search(x, 1)
    return km.centroids, assign.reshape(-1)


def typicality(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, density)``: a seeded sample of at most ``DENSITY_ROWS`` rows of ``x`` and each one's inverse mean
    squared distance to its ``KNN`` nearest among at most ``DENSITY_REFS`` reference rows (a cluster's density,
    estimated at a bounded cost whatever the cluster's size)."""
    rows = np.arange(len(x)) if len(x) <= DENSITY_ROWS else np.sort(rng.choice(len(x), DENSITY_ROWS, replace=False))
    ref = x if len(x) <= DENSITY_REFS else x[np.sort(rng.choice(len(x), DENSITY_REFS, replace=False))]
    d2 = np.maximum(2.0 - 2.0 * (x[rows] @ ref.T), 0.0)  # unit rows: |a - b|^2 = 2 - 2 a.b
    k = min(KNN + 1, ref.shape[0])  # +1: a row is usually its own nearest reference
    nearest = np.partition(d2, k - 1, axis=1)[:, :k]
    return rows, 1.0 / (nearest.mean(axis=1) + 1e-6)


def select_typical(x: np.ndarray, n: int, seed: int, covered: np.ndarray | None = None) -> np.ndarray:
    """Positions of ``n`` rows: the most typical row of each of the largest clusters that no ``covered`` row
    (already labelled, in the same space) falls into."""
    rng = np.random.default_rng(seed)
    n_cov = 0 if covered is None else len(covered)
    centroids, assign = kmeans_assign(x, n + n_cov, seed)
    taken = set()
    if n_cov:
        _, cov = faiss_nearest(centroids, covered)
        taken = set(cov.reshape(-1).tolist())
    sizes = np.bincount(assign, minlength=len(centroids))
    order = sorted((c for c in range(len(centroids)) if c not in taken and sizes[c]), key=lambda c: (-sizes[c], c))
    out = []
    for c in order[:n]:
        members = np.flatnonzero(assign == c)
        rows, density = typicality(x[members], rng)
        out.append(int(members[rows[np.argmax(density)]]))
    return _top_up(np.asarray(out, dtype=np.int64), len(x), n, rng)


def select_kmeans(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    centroids, _ = kmeans_assign(x, n, seed)
    _, nearest = faiss_nearest(x, centroids, k=min(len(x), n))
    out: list[int] = []
    for row in nearest:  # the nearest item not already taken by another centroid
        out.append(next(int(i) for i in row if int(i) not in out))
    return _top_up(np.asarray(out, dtype=np.int64), len(x), n, np.random.default_rng(seed))


def select_kcenter(x: np.ndarray, n: int, seed: int, covered: np.ndarray | None = None) -> np.ndarray:
    """Greedy farthest-first: each pick maximises its distance to everything picked (or covered) before."""
    rng = np.random.default_rng(seed)
    if covered is not None and len(covered):
        dist = np.min(2.0 - 2.0 * (x @ covered.T), axis=1)
        out = []
    else:
        first = int(rng.integers(len(x)))
        dist, out = 2.0 - 2.0 * (x @ x[first]), [first]
    while len(out) < min(n, len(x)):
        nxt = int(np.argmax(dist))
        out.append(nxt)
        dist = np.minimum(dist, 2.0 - 2.0 * (x @ x[nxt]))
        dist[out] = -np.inf
    return np.asarray(out, dtype=np.int64)


def select(x: np.ndarray, n: int, strategy: str, seed: int, covered: np.ndarray | None = None) -> np.ndarray:
    """Positions (into ``x``, already in :func:`as_space`) of ``min(n, len(x))`` distinct rows to label."""
    n = min(int(n), len(x))
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if strategy == "random":
        return np.random.default_rng(seed).choice(len(x), n, replace=False).astype(np.int64)
    if strategy == "kmeans":
        return select_kmeans(x, n, seed)
    if strategy == "kcenter":
        return select_kcenter(x, n, seed, covered)
    if strategy == "typical":
        return select_typical(x, n, seed, covered)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {SELECT_STRATEGIES}")


def uncertainty(probs: np.ndarray, kind: str = "margin") -> np.ndarray:
    """Higher = less certain: ``1 - (p1 - p2)`` (margin) or the normalised entropy, in [0, 1]."""
    p = np.asarray(probs, dtype=np.float64)
    if p.shape[1] < 2:
        return np.zeros(len(p))
    if kind == "entropy":
        return -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(axis=1) / np.log(p.shape[1])
    top2 = -np.partition(-p, 1, axis=1)[:, :2]
    return 1.0 - (top2[:, 0] - top2[:, 1])


def suggest(x: np.ndarray, probs: np.ndarray | None, n: int, strategy: str, seed: int,
            covered: np.ndarray | None = None) -> np.ndarray:
    """Positions of ``min(n, len(x))`` rows ranked most useful first (see the module docstring)."""
    n = min(int(n), len(x))
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if strategy in ("random", "typical"):
        return select(x, n, strategy, seed, covered)
    if strategy not in ("margin", "entropy") or probs is None:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {SUGGEST_STRATEGIES}")
    u = uncertainty(probs, strategy)
    pool = np.argsort(-u, kind="stable")[: min(len(x), POOL_FACTOR * n)]
    _, assign = kmeans_assign(x[pool], n, seed)
    best: dict[int, int] = {}
    for j, pos in enumerate(pool.tolist()):  # pool is most uncertain first: a group's first member is its best
        best.setdefault(int(assign[j]), pos)
    picks = sorted(best.values(), key=lambda p: (-u[p], p))
    return _top_up(np.asarray(picks, dtype=np.int64), len(x), n, np.random.default_rng(seed), order=pool)


def faiss_nearest(x: np.ndarray, queries: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product neighbours of ``queries`` among the rows of ``x``: ``(scores, positions)``."""
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(np.ascontiguousarray(x, dtype=np.float32))
    return index.search(np.ascontiguousarray(queries, dtype=np.float32), k)


def _top_up(picks: np.ndarray, total: int, n: int, rng: np.random.Generator,
            order: np.ndarray | None = None) -> np.ndarray:
    """Fill up to ``n`` distinct positions (k-means can leave clusters empty): from ``order``, else at random."""
    if len(picks) >= n:
        return picks[:n]
    rest = order if order is not None else rng.permutation(total)
    seen = set(picks.tolist())
    extra = [int(i) for i in rest if int(i) not in seen][: n - len(picks)]
    if len(picks) + len(extra) < n:
        extra += [int(i) for i in rng.permutation(total) if int(i) not in seen and int(i) not in extra]
    return np.concatenate([picks, np.asarray(extra[: n - len(picks)], dtype=np.int64)])
