"""The async client (``msn_serve.client.AsyncClient``) against a real server: the same results as the sync
client, concurrent requests over one connection pool, errors and retries decided the same way."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image
from test_client import KEY
from test_client_retry import OK, Scripted, scripted  # noqa: F401 - the fixture

from msn_serve.client import APIConnectionError, AsyncClient, Client, NotFoundError, ServiceUnavailableError


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
        want = c.embeddings.create(imgs[:3]).vectors, c.embeddings.create(imgs[3:]).vectors
        masked = c.embeddings.create(imgs[0], mask={"ratio": 0.5, "seed": 1})

    async def main() -> None:
        async with AsyncClient(srv.url, api_key=KEY) as a:
            assert (await a.ready()).ready
            one, two = await asyncio.gather(*(a.embeddings.create(imgs[i: i + 3]) for i in (0, 3)))  # concurrent
            np.testing.assert_allclose(one.vectors, want[0], atol=1e-5)
            np.testing.assert_allclose(two.vectors, want[1], atol=1e-5)
            m = await a.embeddings.create(encode(imgs[0]), mask={"ratio": 0.5, "seed": 1})
            assert m.keep_idx[0].tolist() == masked.keep_idx[0].tolist()
            np.testing.assert_allclose(m.vectors, masked.vectors, atol=1e-5)
            oa = await a.embeddings.create_v1(imgs[:3])
            np.testing.assert_allclose(oa.vectors, want[0], atol=1e-5)
            await a.indexes.create("a")
            await a.indexes.add("a", [1, 2, 3], images=imgs[:3])
            hits = await a.indexes.search("a", vectors=want[0], k=1)
            assert hits.ids[:, 0].tolist() == [1, 2, 3]
            await a.classifiers.fit("clf", ["p", "q", "p"], index="a", ids=[1, 2, 3])
            assert (await a.classifiers.predict("clf", embeddings=want[0][:1], k=1)).labels == ["p"]
            assert [m.id for m in await a.models.list()] == ["default"]
            with pytest.raises(NotFoundError, match="nope"):
                await a.indexes.delete("nope")
            assert (await a.indexes.delete("a")) == {"deleted": "a"}

    asyncio.run(main())


def test_async_retries_as_the_sync_client(scripted) -> None:  # noqa: F811 - the fixture
    """A 503 is waited out after its ``Retry-After``; a lost answer of a create is raised, of a read retried."""
    s: Scripted = scripted((503, "1"), (200, None), "drop", "drop", (200, None), (503, "1"))

    async def main() -> None:
        async with AsyncClient(s.url) as a:
            assert await a.info() == json.loads(OK)
            with pytest.raises(APIConnectionError):
                await a.indexes.create("x")
            assert await a.indexes.retrieve("x") == json.loads(OK)
            with pytest.raises(ServiceUnavailableError):
                await a.with_options(max_retries=0).info()

    asyncio.run(main())
    assert len(s.seen) == 6 and 1.0 <= s.gaps()[0] < 1.5
