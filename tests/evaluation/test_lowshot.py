import numpy as np
import pytest
from cyanure.data_processing import preprocess

from training.evaluation import lowshot
from training.evaluation.lowshot import center_and_normalize, fit_logistic, lowshot_accuracy, summarize


def gaussian_classes(n: int, *, k: int = 10, d: int = 48, spread: float = 0.5, seed: int = 0):
    """Features of ``k`` Gaussian classes, round-robin labels (a fixed class layout per ``seed``)."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(k, d)) * spread
    labels = np.arange(n) % k
    noise = np.random.default_rng(seed + n).normal(size=(n, d))
    return (means[labels] + noise + 3.0).astype(np.float32), labels


@pytest.mark.parametrize("order", ["C", "F"])
def test_center_and_normalize_any_memory_order(order):
    x = np.asarray(np.random.default_rng(0).normal(2.0, 3.0, size=(6, 5)), order=order)
    before = x.copy()
    out = center_and_normalize(x)
    assert out.flags.c_contiguous
    np.testing.assert_allclose(out.mean(axis=1), 0.0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(x, before)  # input untouched
    reference = np.ascontiguousarray(before)
    preprocess(reference, centering=True, normalize=True, columns=False)  # cyanure on a C array
    np.testing.assert_allclose(out, reference, atol=1e-12)


def test_cyanure_preprocess_is_a_noop_on_fortran_arrays():
    """Why we preprocess in numpy: the quirk this guards against is still there."""
    x = np.asfortranarray(np.random.default_rng(0).normal(size=(4, 3)))
    y = x.copy(order="F")
    preprocess(y, centering=True, normalize=True, columns=False)
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("n", [10, 50, 500])
def test_cyanure_and_sklearn_agree(n):
    x, y = gaussian_classes(n)
    x_test, y_test = gaussian_classes(2000)
    accs = {s: 100 * fit_logistic(x, y, solver=s).accuracy(x_test, y_test) for s in ("cyanure", "sklearn")}
    assert abs(accs["cyanure"] - accs["sklearn"]) <= 0.5, accs
    assert accs["cyanure"] > 30  # well above the 10 % chance level


def test_official_hyperparameters_reach_cyanure(monkeypatch):
    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def fit(self, x, y):
            seen["x"] = x
            self.classes_ = np.unique(y)
            self.coef_ = np.zeros((x.shape[1], len(self.classes_)))

    import cyanure.estimators

    monkeypatch.setattr(cyanure.estimators, "Classifier", Recorder)
    x, y = gaussian_classes(40, k=4, d=6)
    fit_logistic(np.asfortranarray(x), y, lambd=0.004)
    assert seen["lambda_1"] == pytest.approx(0.004 / 40)
    assert (seen["loss"], seen["penalty"], seen["fit_intercept"]) == ("multiclass-logistic", "l2", False)
    assert seen["x"].flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(seen["x"], axis=1), 1.0)


def test_summarize_reports_mean_and_std_per_setting_and_lambda():
    x, y = gaussian_classes(100, k=4, d=8)
    x_test, y_test = gaussian_classes(200, k=4, d=8)
    subsets = {"1imgs_class": [np.arange(4), np.arange(4, 8)], "5imgs_class": [np.arange(20)]}
    results = summarize(x, y, x_test, y_test, subsets, lambdas=(lowshot.DEFAULT_LAMBD, 0.25))
    assert [(r.setting, r.lambd, len(r.accuracies)) for r in results] == [
        ("1imgs_class", 0.00025, 2), ("1imgs_class", 0.25, 2), ("5imgs_class", 0.00025, 1), ("5imgs_class", 0.25, 1)]
    first = results[0]
    assert first.mean == pytest.approx(np.mean(first.accuracies))
    assert first.std == pytest.approx(np.std(first.accuracies, ddof=1))
    assert first.accuracies[0] == pytest.approx(lowshot_accuracy(x[:4], y[:4], x_test, y_test))


def test_single_class_is_rejected():
    with pytest.raises(ValueError):
        fit_logistic(np.ones((3, 2)), np.zeros(3))


def test_two_classes_use_the_logistic_loss_and_match_sklearn():
    """cyanure's multiclass loss degrades to square loss for 2 classes; the fit must still be logistic."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 8))
    y = np.where(x[:, 0] + 0.5 * rng.normal(size=40) > 0, 7, 2)
    cy = fit_logistic(x, y, lambd=0.01, tol=1e-6)
    sk = fit_logistic(x, y, lambd=0.01, solver="sklearn")
    assert list(cy.classes) == list(sk.classes) == [2, 7]
    # Same objective, so the same logistic margins (square loss would give a differently scaled margin).
    margin_cy, margin_sk = cy.coef[:, 1] - cy.coef[:, 0], sk.coef[:, 1] - sk.coef[:, 0]
    np.testing.assert_allclose(margin_cy, margin_sk, rtol=0.02, atol=1e-3)
