"""An auto index over HTTP: created exact, re-tuned in the background once it holds ``exact_below`` vectors."""
from __future__ import annotations

import time

import numpy as np
from serve_helpers import Server


def test_auto_index_over_http_retunes_and_keeps_answering(server: Server):
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((8, 64))
    x = centres[rng.integers(0, 8, 1_200)] + 0.3 * rng.standard_normal((1_200, 64))
    with server.client() as c:
        r = c.post("/index/grow", json={"type": "auto", "exact_below": 1_000, "target_recall": 0.9})
        assert r.status_code == 201, r.text
        assert r.json()["type"] == "flat" and r.json()["auto_tuning"]["next_tuning"] == 1_000
        for lo in range(0, 1_200, 300):
            r = c.post("/index/grow/add", json={"ids": list(range(lo, lo + 300)), "vectors": x[lo:lo + 300].tolist()})
            assert r.status_code == 200, r.text
            hits = c.post("/index/grow/search", json={"vectors": x[:1].tolist(), "k": 3}).json()["results"][0]
            assert hits[0]["id"] == 0  # answers throughout, before, during and after the re-tune
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = c.get("/index/grow").json()
            if stats["auto_tuning"]["last_tuning"] and not stats["auto_tuning"]["retuning"]:
                break
            time.sleep(0.1)
        assert stats["type"] == "ivf" and stats["ntotal"] == 1_200 and stats["tuned_at"] >= 1_000
        tuning = stats["auto_tuning"]["last_tuning"]
        assert tuning["chosen"] == "ivf" and tuning["candidates"][0]["memory_bytes"] > 0
        assert c.post("/index/grow/delete", json={"ids": [5]}).json()["removed"] == 1  # deletes: IVF-Flat only
        assert c.post("/index/x", json={"type": "auto", "target_recall": 2}).status_code == 422
