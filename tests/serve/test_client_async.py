"""The async client (``msn_serve.client.AsyncClient``) against a real server: the same results as the sync
client, concurrent requests over one connection pool, errors and retries the same way."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image
from test_client import KEY, _Flaky

from msn_serve.client import AsyncClient, Client, NotFound, RetryPolicy, ServiceUnavailable


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("aclient")
    (root / "key").write_text(KEY + "\n")
    s = Server(bundle_dir, root / "data", "--api-key-file", str(root / "key"))
    yield s.start()
    s.stop()


def test_async_client_matches_the_sync_one(srv: Server) -> None:
    imgs = [random_image(30 + i) for i in range(6)]
    with Client(srv.url, api_key=KEY) as c:
        want = c.embed(imgs[:3]).vectors, c.embed(imgs[3:]).vectors
        masked = c.embed(imgs[0], mask={"ratio": 0.5, "seed": 1})

    async def main() -> None:
        async with AsyncClient(srv.url, api_key=KEY) as a:
            assert (await a.ready()).ready
            one, two = await asyncio.gather(*(a.embed(imgs[i: i + 3]) for i in (0, 3)))  # concurrent
            np.testing.assert_allclose(one.vectors, want[0], atol=1e-5)
            np.testing.assert_allclose(two.vectors, want[1], atol=1e-5)
            m = await a.embed(encode(imgs[0]), mask={"ratio": 0.5, "seed": 1})
            assert m.keep_idx[0].tolist() == masked.keep_idx[0].tolist()
            np.testing.assert_allclose(m.vectors, masked.vectors, atol=1e-5)
            oa = await a.embeddings(imgs[:3])
            np.testing.assert_allclose(oa.vectors, want[0], atol=1e-5)
            await a.create_index("a")
            await a.add("a", [1, 2, 3], images=imgs[:3])
            hits = await a.search("a", vectors=want[0], k=1)
            assert hits.ids[:, 0].tolist() == [1, 2, 3]
            await a.fit("clf", ["p", "q", "p"], index="a", ids=[1, 2, 3])
            assert (await a.predict("clf", embeddings=want[0][:1], k=1)).labels == ["p"]
            with pytest.raises(NotFound, match="nope"):
                await a.delete_index("nope")
            assert (await a.delete_index("a")) == {"deleted": "a"}

    asyncio.run(main())


def test_async_retry_after() -> None:
    flaky = _Flaky(fail=1, retry_after="1")
    try:
        async def main() -> dict:
            async with AsyncClient(flaky.url) as a:
                return await a.info()

        assert asyncio.run(main()) == {"status": "ok"}
        assert len(flaky.times) == 2 and flaky.times[1] - flaky.times[0] >= 0.95
    finally:
        flaky.close()
    always = _Flaky(fail=100, retry_after="100")
    try:
        async def fails() -> None:
            async with AsyncClient(always.url, retry=RetryPolicy(max_attempts=2, max_delay_s=0.01)) as a:
                await a.info()

        with pytest.raises(ServiceUnavailable) as e:
            asyncio.run(fails())
        assert e.value.attempts == 2 and len(always.times) == 2
    finally:
        always.close()
