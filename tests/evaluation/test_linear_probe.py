import numpy as np
import torch

from training.evaluation.linear_probe import LinearClassifier, train_linear_probe


def test_probe_learns_a_linearly_separable_problem():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=600)
    directions = np.eye(3, 16) * 4
    features = (directions[labels] + rng.normal(size=(600, 16))).astype(np.float32)
    result = train_linear_probe(features[:400], labels[:400] + 5, features[400:], labels[400:] + 5, epochs=10,
                                batch_size=64)
    assert result.test_accuracy > 90
    assert result.lr == 6.4 * 64 / 8192


def test_classifier_is_scale_invariant_in_its_input():
    torch.manual_seed(0)
    model = LinearClassifier(8, 3)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), model(10 * x), atol=1e-5, rtol=1e-4)
