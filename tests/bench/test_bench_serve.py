"""`forklift bench serve`: exact synthetic prompts, and the --quick sweep end to end."""

from __future__ import annotations

import json
import shlex
import sys

import httpx
import pytest

from forklift.bench.serve import ServeSettings
from forklift.bench.server_process import free_loopback_port
from forklift.bench.synthetic_prompt import synthetic_prompt
from forklift.cli import main
from forklift.tokenizer import load_tokenizer


def test_synthetic_prompts_have_exact_lengths_and_no_shared_prefix(default_source):
    tokenizer = load_tokenizer(default_source)
    prompts = [synthetic_prompt(tokenizer, 564, seed) for seed in range(12)]
    for prompt in prompts:
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) == 564
    firsts = {tuple(tokenizer.encode(p, add_special_tokens=False)[:4]) for p in prompts}
    assert len(firsts) == len(prompts)
    with pytest.raises(ValueError, match="num_tokens"):
        synthetic_prompt(tokenizer, 1, 0)


def test_requests_per_level_follow_the_rule():
    settings = ServeSettings()
    assert [settings.requests_at(c) for c in settings.concurrencies] == [8, 16, 32, 64, 128]
    with pytest.raises(ValueError, match="endpoint"):
        ServeSettings(endpoint="embeddings").validate()
    with pytest.raises(ValueError, match="peer_url"):
        ServeSettings(peer_command="vllm serve").validate()


@pytest.mark.slow
def test_quick_serve_sweep_against_a_started_server_and_a_peer(tmp_path):
    # The peer is a second forklift server (any OpenAI-compatible server will do), started by
    # a shell command once forklift's sweep is over and stopped after its own.
    port = free_loopback_port()
    peer_url = f"http://127.0.0.1:{port}/v1"
    serve = [sys.executable, "-m", "forklift.cli", "serve", "--host", "127.0.0.1"]
    peer_command = shlex.join([*serve, "--port", str(port), "--max-model-len", "512"])
    args = ["bench", "serve", "--quick", "--peer-url", peer_url, "--peer-command", peer_command,
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    with pytest.raises(httpx.ConnectError):  # the peer and what it started are gone
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    report = json.loads((tmp_path / "serve.json").read_text())
    markdown = (tmp_path / "serve.md").read_text()
    assert markdown.startswith("# Serving sweep")
    assert "## Side by side: forklift vs peer" in markdown
    assert "each server had the machine and its memory to itself" in markdown
    assert report["peer"]["started_after_forklift"] is True
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert report["command"] == shlex.join(
        ["forklift", "bench", "serve", "--quick", "--peer-url", peer_url, "--peer-command",
         peer_command]
    )  # fmt: skip
    peer_levels = report["peer"]["levels"]
    assert [lv["completed"] for lv in peer_levels] == report["workload"]["requests_per_level"]
    for level, theirs, ratio in zip(report["levels"], peer_levels, report["ratios"], strict=True):
        assert ratio["concurrency"] == level["concurrency"] == theirs["concurrency"]
        assert ratio["output_tokens_per_s"] == pytest.approx(
            level["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        )
        # The started server's CPU time was sampled; the event loop is a part of it.
        assert 0 <= level["event_loop_cpu_s"] < level["server_cpu_s"]
        assert theirs["server_cpu_s"] is None  # a peer's process is not ours to watch
    work = report["workload"]
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == work["concurrencies"]
    for level, expected in zip(levels, work["requests_per_level"], strict=True):
        assert level["num_requests"] == level["completed"] == expected
        assert level["errors"] == []
        # The server counted exactly the prompt we built, and every request ran to length.
        assert level["prompt_tokens"] == [work["input_tokens"]]
        assert level["per_request_output_tokens"] == [work["output_tokens"]] * expected
        assert level["output_tokens"] == expected * work["output_tokens"]
        assert level["output_tokens_per_s"] == pytest.approx(
            level["output_tokens"] / level["wall_s"]
        )
        assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"]
        assert 0 < level["itl_ms_p50"] <= level["itl_ms_p99"]
        assert level["e2e_s_p50"] <= level["e2e_s_p99"] <= level["wall_s"]
        assert level["scaling"] == pytest.approx(
            level["output_tokens_per_s"] / levels[0]["output_tokens_per_s"]
        )


# Stands in for llama.cpp's server: records its command line, then serves the same GGUF
# with forklift (any OpenAI-compatible server on that port will do).
FAKE_LLAMA_SERVER = """#!{python}
import json, os, sys
args = sys.argv[1:]
port = args[args.index("--port") + 1]
with open(os.path.join(os.path.dirname(sys.argv[0]), "args.json"), "w") as out:
    out.write(json.dumps(args))
os.execv(sys.executable, [sys.executable, "-m", "forklift.cli", "serve", "--host", "127.0.0.1",
                          "--port", port, "--model", args[args.index("-m") + 1],
                          "--max-model-len", "512"])
"""


@pytest.mark.slow
def test_llama_server_is_started_with_fair_settings_and_loaded_the_same_way(
    tmp_path, default_source
):
    import sys

    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    out = tmp_path / "out"
    args = ["bench", "serve", "--quick", "--concurrency", "2", "--llama-server", str(binary),
            "--peer-threads", "2", "--out-dir", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "serve.json").read_text())
    assert report["peer"]["name"] == "llama-server"
    assert "--llama-server llama-server" in report["command"]  # not this machine's path
    assert [lv["completed"] for lv in report["peer"]["levels"]] == [4]
    started = json.loads((tmp_path / "args.json").read_text())
    flag = {started[i]: started[i + 1] for i in range(len(started) - 1)
            if started[i].startswith("-")}  # fmt: skip
    assert flag["-m"] == str(default_source.path)
    assert (flag["-t"], flag["-tb"], flag["-np"], flag["-c"]) == ("2", "2", "8", "8192")
    assert (flag["--cache-ram"], flag["-fa"]) == ("0", "off")
    assert "--no-webui" in started
