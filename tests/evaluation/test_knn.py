import numpy as np
import pytest

from training.evaluation.knn import knn_accuracy, knn_predict, l2_normalize


def unit(angle_deg: float) -> list[float]:
    a = np.deg2rad(angle_deg)
    return [np.cos(a), np.sin(a)]


def test_temperature_weighting_beats_majority():
    """One very close class-0 neighbour outvotes two farther class-1 neighbours at T = 0.07."""
    train = np.array([unit(0), unit(40), unit(-40)]) * [[1.0], [5.0], [0.2]]  # norms must not matter
    labels = np.array([0, 1, 1])
    query = np.array([unit(5)])
    assert knn_predict(train, labels, query, k=3).tolist() == [0]
    # exp(cos/T) votes: class 0 gets exp(cos 5°/T); class 1 gets exp(cos 35°/T) + exp(cos 45°/T).
    votes0 = np.exp(np.cos(np.deg2rad(5)) / 0.07)
    votes1 = np.exp(np.cos(np.deg2rad(35)) / 0.07) + np.exp(np.cos(np.deg2rad(45)) / 0.07)
    assert votes0 > votes1
    # A flat vote (very high temperature) is a plain majority: class 1.
    assert knn_predict(train, labels, query, k=3, temperature=1e3).tolist() == [1]
    # k = 1 is the nearest neighbour, whatever the temperature.
    assert knn_predict(train, labels, np.array([unit(30)]), k=1).tolist() == [1]


def test_known_answer_on_clusters_and_label_values():
    angles = {7: 0, 3: 120, 11: 240}  # arbitrary label values
    train, labels = [], []
    for label, centre in angles.items():
        for offset in (-10, -5, 0, 5, 10):
            train.append(unit(centre + offset))
            labels.append(label)
    queries = np.array([unit(2), unit(118), unit(250), unit(60.5)])
    predictions = knn_predict(np.array(train), np.array(labels), queries, k=5, chunk_size=2)
    assert predictions[:3].tolist() == [7, 3, 11]
    assert predictions[3] == 3  # 60.5° is nearer 120-10 = 110° than 0+10 = 10°
    assert knn_accuracy(np.array(train), np.array(labels), queries[:3], [7, 3, 11], k=5) == pytest.approx(100.0)


def test_k_larger_than_train_and_normalisation():
    train = np.array([[3.0, 0.0], [0.0, 0.5]])
    assert knn_predict(train, [0, 1], np.array([[1.0, 0.2]]), k=20).tolist() == [0]
    np.testing.assert_allclose(np.linalg.norm(l2_normalize(train), axis=1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError):
        knn_predict(train, [0, 1], train, temperature=0.0)
