"""The route: weights split requests exactly as smooth weighted round robin does, the proxy passes answers through
and meters every completion by version and status code, and a version that cannot be reached answers 502.

Run: .venv/bin/pytest tests/gpu_train/serving/test_router.py -q
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpu_train.serving.metrics import RouteMetrics
from gpu_train.serving.router import Route, RouteBackend, backends_from, create_app


def picks(weights: dict[str, int], n: int) -> list[str]:
    route = Route("chat", [RouteBackend(v, f"http://{v}", w) for v, w in weights.items()])
    return [route.pick().version for _ in range(n)]


def test_smooth_weighted_round_robin_splits_every_run_exactly():
    # nginx's algorithm by hand for 90/10: each pick adds 90 to version 3's score and 10 to 4's, and the chosen one
    # pays back 100. The scores meet at pick 4 (50 each; a tie goes to the first listed), 4 leads at pick 5 (40 vs
    # 60), and the same every 10 picks after.
    got = picks({"3": 90, "4": 10}, 100)
    assert got.count("4") == 10 and got.count("3") == 90
    assert [i for i, v in enumerate(got[:20]) if v == "4"] == [5, 15]
    assert picks({"3": 50, "4": 50}, 6) == ["3", "4", "3", "4", "3", "4"]
    assert set(picks({"3": 100, "4": 0}, 10)) == {"3"}


@pytest.mark.parametrize("doc", [{"backends": []}, {"backends": [{"version": "3", "url": "u", "weight": 90}]},
                                 {"backends": [{"version": "3", "url": "u", "weight": 110},
                                               {"version": "4", "url": "v", "weight": -10}]}])
def test_a_route_whose_weights_do_not_add_up_is_refused(doc):
    with pytest.raises(ValueError, match="weights add up to 100"):
        backends_from(doc)


def upstream(version: str, status: int = 200) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"choices": [{"text": f"from {version}: {body['prompt']}"}]}, status=status)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "chat", "served_by": version}]})

    app = web.Application()
    app.router.add_post("/openai/v1/completions", completions)
    app.router.add_get("/openai/v1/models", models)
    return app


@pytest.mark.integration
def test_the_route_proxies_meters_and_reports_an_unreachable_version():
    async def scenario() -> None:
        good, failing = TestServer(upstream("3")), TestServer(upstream("4", status=500))
        await good.start_server()
        await failing.start_server()
        route = Route("chat", [RouteBackend("3", str(good.make_url("")).rstrip("/"), 50, "stable"),
                               RouteBackend("4", str(failing.make_url("")).rstrip("/"), 50, "canary")])
        metrics = RouteMetrics()
        client = TestClient(TestServer(create_app(route, metrics)))
        await client.start_server()
        try:
            answers = []
            for i in range(4):
                resp = await client.post("/v1/completions", json={"model": "chat", "prompt": f"p{i}"})
                answers.append((resp.status, resp.headers["x-gpu-train-model-version"], await resp.json()))
            assert [(s, v) for s, v, _ in answers] == [(200, "3"), (500, "4"), (200, "3"), (500, "4")]
            assert answers[0][2] == {"choices": [{"text": "from 3: p0"}]}
            # The model list goes to the stable version and is not metered.
            resp = await client.get("/openai/v1/models")
            assert (await resp.json())["data"][0]["served_by"] == "3"
            await failing.close()  # version 4 goes away: its share answers 502, metered against it
            route.set([RouteBackend("3", route.backends()[0].url, 50, "stable"),
                       RouteBackend("4", route.backends()[1].url, 50, "canary")])
            codes = [(await client.post("/v1/completions", json={"prompt": "x"})).status for _ in range(2)]
            assert sorted(codes) == [200, 502]
            text = (await (await client.get("/metrics")).read()).decode()
            assert 'gpu_train_route_requests_total{code="200",service="chat",version="3"} 3.0' in text
            assert 'gpu_train_route_requests_total{code="500",service="chat",version="4"} 2.0' in text
            assert 'gpu_train_route_requests_total{code="502",service="chat",version="4"} 1.0' in text
            assert 'gpu_train_route_weight_percent{service="chat",version="4"} 50.0' in text
            assert 'gpu_train_route_request_duration_seconds_count{service="chat",version="3"} 3.0' in text
        finally:
            await client.close()
            await good.close()

    asyncio.run(scenario())
