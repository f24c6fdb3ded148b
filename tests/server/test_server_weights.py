"""The trainer-facing HTTP routes, driven from another process: weights, pause, cache."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from server_harness import running_server
from tiny_models import hf_greedy, make_tiny_model

from forklift import EngineConfig, LLMEngine
from forklift.server.app import build_app

KEY = "trainer-secret"
PROMPT = [5, 17, 33, 9, 41, 12, 7, 88, 3, 60, 21, 14, 99, 45, 6, 30, 72, 11]

# Runs in a separate Python process: perturbs the checkpoint, pushes it in two pieces,
# commits, and asks for a greedy completion.
TRAINER = """
import json, sys
import httpx, torch
from safetensors.torch import load_file, save
url, key, checkpoint = sys.argv[1:4]
prompt = json.loads(sys.argv[4])
headers = {"Authorization": f"Bearer {key}"}
state = load_file(checkpoint)
generator = torch.Generator().manual_seed(11)
state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in sorted(state.items())}
names = sorted(state)
pieces = [names[: len(names) // 2], names[len(names) // 2 :]]
with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
    for piece in pieces:
        body = save({k: state[k].contiguous() for k in piece})
        response = client.post("/v1/weights", content=body)
        response.raise_for_status()
        print("staged", response.json()["staged"], file=sys.stderr)
    commit = client.post("/v1/weights/commit").json()
    version = client.get("/v1/weights/version").json()["weight_version"]
    completion = client.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "logprobs": 0,
    }).json()
    print(json.dumps({"commit": commit, "version": version,
                      "text": completion["choices"][0]["text"]}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-weights"))


@pytest.fixture(scope="module")
def server(tiny):
    engine = LLMEngine(
        EngineConfig(model=str(tiny.path), dtype="float32", max_model_len=128, block_size=4)
    )
    app = build_app(engine, "tiny", api_key=KEY, enable_trainer_routes=True)
    with running_server(app) as url:
        yield url, engine


def authed(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_a_trainer_process_pushes_weights_over_http(server, tiny, tmp_path):
    url, engine = server
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    checkpoint = tiny.path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, str(script), url, KEY, str(checkpoint), json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    num_tensors = len(tiny.hf_model.state_dict())
    assert report["commit"] == {"applied": num_tensors, "weight_version": 1}
    assert report["version"] == engine.weight_version == 1
    # The same perturbation applied to the HF oracle gives the same greedy tokens.
    generator = torch.Generator().manual_seed(11)
    state = tiny.hf_model.state_dict()
    perturbed = {
        k: state[k] + 0.05 * torch.randn(state[k].shape, generator=generator) for k in sorted(state)
    }
    oracle = copy.deepcopy(tiny.hf_model)
    oracle.load_state_dict(perturbed)
    expected, _ = hf_greedy(oracle, PROMPT, 8)
    assert report["text"].split() == [f"w{t}" for t in expected]


def test_admin_routes_need_the_key_and_reject_bad_input(server):
    url, engine = server
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        for path in ("/v1/weights", "/v1/weights/commit", "/pause", "/reset_prefix_cache"):
            assert anonymous.post(path).status_code == 401
    with authed(url) as client:
        bad = client.post("/v1/weights", content=b"not safetensors")
        assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
        empty = client.post("/v1/weights/commit")
        assert empty.status_code == 400 and "staged" in empty.json()["error"]["message"]
        from safetensors.torch import save

        wrong = client.post("/v1/weights", content=save({"model.norm.weight": torch.ones(3)}))
        assert wrong.status_code == 400 and "shape" in wrong.json()["error"]["message"]
        assert engine.num_staged_weights == 0
        assert client.post("/reset_prefix_cache").status_code == 200


def test_pause_holds_requests_until_resume(server):
    url, engine = server
    with authed(url) as client:
        assert client.post("/pause").json() == {"paused": True}
        assert client.get("/is_paused").json() == {"paused": True}
        result: dict[str, object] = {}

        def request() -> None:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
            result["response"] = client.post("/v1/completions", json=body)

        worker = threading.Thread(target=request)
        worker.start()
        time.sleep(1.0)
        assert worker.is_alive()  # held, not lost
        assert client.post("/resume").json() == {"paused": False}
        worker.join(timeout=30)
        response = result["response"]
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4


TRAINER_ROUTES = (
    "/v1/weights",
    "/v1/weights/commit",
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
)


def test_trainer_routes_are_off_unless_enabled(tiny):
    engine = LLMEngine(
        EngineConfig(model=str(tiny.path), dtype="float32", max_model_len=64, block_size=4)
    )
    with running_server(build_app(engine, "tiny")) as url:
        for path in TRAINER_ROUTES:
            response = httpx.post(url + path, content=b"x")
            assert response.status_code == 404, path
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(url + "/is_paused").status_code == 404
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("host", "api_key", "enabled", "refused"),
    [
        ("0.0.0.0", None, True, True),
        ("192.168.1.5", None, True, True),
        ("my-host.example", None, True, True),
        ("0.0.0.0", "k", True, False),
        ("127.0.0.1", None, True, False),
        ("localhost", None, True, False),
        ("::1", None, True, False),
        ("0.0.0.0", None, False, False),
    ],
)
def test_trainer_routes_on_the_network_need_an_api_key(host, api_key, enabled, refused):
    from forklift.server.exposure import check_trainer_routes_exposure

    if refused:
        with pytest.raises(ValueError, match="add --api-key KEY"):
            check_trainer_routes_exposure(host, api_key, enabled)
    else:
        check_trainer_routes_exposure(host, api_key, enabled)


def test_forklift_serve_refuses_open_trainer_routes_before_loading_anything():
    from server_harness import forklift_command

    done = subprocess.run(
        [*forklift_command(), "serve", "--host", "0.0.0.0", "--enable-trainer-routes"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--enable-trainer-routes" in done.stderr and "--api-key" in done.stderr
