"""Multi-turn chat served on a hybrid model: forklift against llama-server on the same
`qwen35` GGUF file (make_hybrid_gguf.py makes a Qwen3.5-0.8B-shaped one), one server at a
time, in one run.

`--conversations` conversations run at once, each `--turns` turns long: a conversation opens
with its own `--system`-token system prompt, and each turn appends `--user` new tokens to the
history and streams a `--reply`-token answer (temperature 0, end of text ignored), then sends
the next turn straight away. The history travels in token ids (forklift: `return_token_ids`;
llama-server: `return_tokens`), so each turn's prompt extends the last turn's prompt and
output exactly, as a chat client's re-rendered history does with a real model. Each server
keeps what it caches by default: forklift its prefix blocks and state checkpoints,
llama-server its slots (one per conversation) and context checkpoints. forklift without
prefix caching runs too, for the size of the cache's part.

    .venv/bin/python benchmarks/scripts/hybrid_multi_turn_serve.py \\
        --model OUT_DIR/qwen35-0.8b-random.Q4_K_M.gguf --llama-cpp $HOME/.cache/llama-cpp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from results import command_line, write_results
from revision_build import ROOT, revision_worktree

from forklift.bench.report import cpu_flags
from forklift.bench.server_process import forklift_server_process, llama_server_process
from forklift.cpu import host_cpu_flags

# Token ids drawn for prompts: clear of the vocabulary's first (byte and special) entries.
TOKEN_RANGE = (1000, 100_000)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the server ran through the model (not from a cache)
    output_tokens: int  # generated, by the server's count
    streamed_ids: int  # of them, the ids the stream carried (the history goes on with these)
    ttft_s: float
    seconds: float
    started_s: float  # since the run began
    output_ids: list[int]


# One streamed turn: (prompt ids) -> (output ids as streamed, tokens generated, computed
# prompt tokens, ttft).
TurnRequest = Callable[[httpx.Client, list[int]], tuple[list[int], int, int, float]]


def _events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def forklift_turn(url: str, model: str, reply: int) -> TurnRequest:
    def request(client: httpx.Client, prompt: list[int]) -> tuple[list[int], int, int, float]:
        body = {
            "model": model, "prompt": prompt, "max_tokens": reply, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        start, first, output, cached = time.perf_counter(), None, [], 0
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for event in _events(response):
                for choice in event.get("choices", []):
                    if choice.get("token_ids") and first is None:
                        first = time.perf_counter() - start
                    output += choice.get("token_ids", [])
                if event.get("usage"):
                    details = event["usage"].get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") or 0
        return output, len(output), len(prompt) - cached, first or 0.0

    return request


def llama_turn(url: str, reply: int) -> TurnRequest:
    def request(client: httpx.Client, prompt: list[int]) -> tuple[list[int], int, int, float]:
        body = {
            "prompt": prompt, "n_predict": reply, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_tokens": True, "cache_prompt": True,
        }  # fmt: skip
        start, first, output, computed = time.perf_counter(), None, [], len(prompt)
        generated = None
        with client.stream("POST", f"{url}/completion", json=body) as response:
            response.raise_for_status()
            for event in _events(response):
                tokens = event.get("tokens") or []
                if tokens and first is None:
                    first = time.perf_counter() - start
                output += tokens
                if event.get("stop") and "timings" in event:
                    computed = int(event["timings"]["prompt_n"])
                    generated = int(event["timings"]["predicted_n"])
        # The stream can hold back a token whose text ends inside a UTF-8 character and
        # never send its id: the count comes from the server's own timings.
        return output, len(output) if generated is None else generated, computed, first or 0.0

    return request


def run_conversations(request: TurnRequest, args: argparse.Namespace, seed: int) -> list[Turn]:
    """`args.conversations` conversations at once, each in its own thread and client."""
    turns: list[Turn] = []
    lock = threading.Lock()
    begin = time.perf_counter()

    def conversation(index: int) -> None:
        rng = random.Random(seed * 1000 + index)

        def draw(count: int) -> list[int]:
            return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]

        history = draw(args.system)
        # A connection per turn: llama-server drops a kept-alive one after a stream.
        with httpx.Client(timeout=600, headers={"Connection": "close"}) as client:
            for turn in range(args.turns):
                prompt = history + draw(args.user)
                started = time.perf_counter()
                output, generated, computed, ttft = request(client, prompt)
                seconds = time.perf_counter() - started
                with lock:
                    turns.append(Turn(index, turn, len(prompt), computed, generated, len(output),
                                      ttft, seconds, started - begin, output))  # fmt: skip
                if generated != args.reply:
                    raise RuntimeError(f"turn {turn}: {generated} tokens, not {args.reply}")
                history = prompt + output

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(args.conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(turns) != args.conversations * args.turns:
        raise RuntimeError("a conversation stopped early (see the error above)")
    return turns


def summarize(turns: list[Turn]) -> dict:
    end = max(t.started_s + t.seconds for t in turns)
    by_turn = {}
    for index in sorted({t.turn for t in turns}):
        mine = [t for t in turns if t.turn == index]
        by_turn[index] = {
            "ttft_p50_s": statistics.median(t.ttft_s for t in mine),
            "computed_mean": statistics.mean(t.computed_tokens for t in mine),
            "prompt_mean": statistics.mean(t.prompt_tokens for t in mine),
        }
    later = [t for t in turns if t.turn > 0]
    return {
        "wall_s": end,
        "output_tok_s": sum(t.output_tokens for t in turns) / end,
        "ttft_p50_s": statistics.median(t.ttft_s for t in turns),
        "ttft_p50_later_turns_s": statistics.median(t.ttft_s for t in later),
        "ttft_max_s": max(t.ttft_s for t in turns),
        "computed_later_turns_mean": statistics.mean(t.computed_tokens for t in later),
        "turns_missing_ids": sum(t.streamed_ids != t.output_tokens for t in turns),
        "by_turn": by_turn,
    }


def side(name: str, request: TurnRequest, args: argparse.Namespace) -> dict:
    with httpx.Client(timeout=600) as client:  # warm up: kernels built, caches touched
        request(client, [TOKEN_RANGE[0] + i for i in range(64)])
    turns = run_conversations(request, args, seed=1)
    summary = summarize(turns)
    print(f"{name}: {summary['output_tok_s']:.1f} out tok/s, "
          f"TTFT p50 {summary['ttft_p50_s'] * 1000:.0f} ms", flush=True)  # fmt: skip
    return {"summary": summary, "turns": [{k: v for k, v in asdict(t).items()
                                           if k != "output_ids"} for t in turns]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="llama.cpp's directory (build/bin/llama-server under it)")  # fmt: skip
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=500)
    parser.add_argument("--user", type=int, default=64)
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    parser.add_argument("--baseline", help="a git revision whose forklift serves a row too")
    args = parser.parse_args()
    context = args.system + args.turns * (args.user + args.reply)
    slot_tokens = 1024 * -(-context // 1024)
    results: dict[str, dict] = {}

    serve = ["--model", str(args.model), "--max-model-len", str(slot_tokens),
             "--num-threads", str(args.threads)]  # fmt: skip
    with forklift_server_process(serve) as (url, _):
        results["forklift"] = side("forklift", forklift_turn(url, _served(url), args.reply), args)
    if args.baseline:
        label = f"forklift at {args.baseline}"
        with baseline_tree(args.baseline), forklift_server_process(serve) as (url, _):
            results[label] = side(label, forklift_turn(url, _served(url), args.reply), args)
    binary = args.llama_cpp / "build" / "bin" / "llama-server"
    with llama_server_process(str(binary), args.model, args.threads, slots=args.conversations,
                              slot_tokens=slot_tokens) as (url, _):  # fmt: skip
        results["llama-server"] = side("llama-server", llama_turn(url, args.reply), args)
    with forklift_server_process([*serve, "--no-enable-prefix-caching"]) as (url, _):
        results["forklift, no prefix caching"] = side(
            "forklift, no prefix caching", forklift_turn(url, _served(url), args.reply), args
        )

    report = {
        "workload": {k: getattr(args, k) for k in
                     ("conversations", "turns", "system", "user", "reply", "threads")},
        "model": args.model.name,
        "results": results,
        "cpu_flags": sorted(cpu_flags()),
        "host_cpu_flags": sorted(host_cpu_flags()),
    }  # fmt: skip
    baseline = ("--baseline", args.baseline) if args.baseline else ()
    command = command_line(
        __file__, "--model", args.model.name, "--llama-cpp", "LLAMA_CPP_DIR", *baseline
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.out_dir, "hybrid-multi-turn-serve", report, table(report), command)


@contextmanager
def baseline_tree(revision: str) -> Iterator[None]:
    """A worktree of `revision` first on the servers' PYTHONPATH while the block runs."""
    with revision_worktree(revision) as tree:
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(tree)
        try:
            yield
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before


def _served(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def table(report: dict) -> list[str]:
    w = report["workload"]
    ours = report["results"]["forklift"]["summary"]
    lines = [
        "# Multi-turn chat on a Qwen3.5-shaped hybrid: forklift vs llama-server",
        "",
        f"{report['model']}: {w['conversations']} conversations at once, {w['turns']} turns "
        f"each; a {w['system']}-token system prompt, then per turn {w['user']} new tokens in "
        f"and {w['reply']} out (streamed, temperature 0). One server at a time, "
        f"{w['threads']} threads; the history sent back in token ids.",
        "",
        "| server | output tok/s | TTFT p50 | TTFT p50, turns 2+ | TTFT max | "
        "prompt tokens computed per turn 2+ | forklift's output tok/s over this row's |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in report["results"].items():
        s = result["summary"]
        lines.append(
            f"| {name} | {s['output_tok_s']:.1f} | {s['ttft_p50_s'] * 1000:.0f} ms | "
            f"{s['ttft_p50_later_turns_s'] * 1000:.0f} ms | {s['ttft_max_s'] * 1000:.0f} ms | "
            f"{s['computed_later_turns_mean']:.0f} | "
            f"{ours['output_tok_s'] / s['output_tok_s']:.2f}x |"
        )
    lines += ["", "TTFT p50 by turn (ms):", "",
              "| turn | " + " | ".join(report["results"]) + " |",
              "|---|" + "---|" * len(report["results"])]  # fmt: skip
    for turn in sorted(ours["by_turn"], key=int):
        cells = [f"{r['summary']['by_turn'][turn]['ttft_p50_s'] * 1000:.0f}"
                 for r in report["results"].values()]  # fmt: skip
        lines.append(f"| {int(turn) + 1} | " + " | ".join(cells) + " |")
    last = max(ours["by_turn"], key=int)
    results = report["results"]
    uncached = results["forklift, no prefix caching"]["summary"]["by_turn"][last]["ttft_p50_s"]
    llama = results["llama-server"]["summary"]["by_turn"][last]["ttft_p50_s"]
    mine = ours["by_turn"][last]["ttft_p50_s"]
    lines += [
        "",
        f"The last turn's first token: {uncached / mine:.1f}x sooner with prefix caching than "
        f"without, {llama / mine:.2f}x sooner than llama-server's.",
        "",
    ]
    missing = {name: r["summary"].get("turns_missing_ids", 0) for name, r in results.items()}
    if any(missing.values()):
        lines += [
            "Turns whose stream lacked some output ids (a token held back inside a UTF-8 "
            "character; the server's own count of generated tokens is used, and the history "
            "goes on without them): "
            + ", ".join(f"{name} {count}" for name, count in missing.items())
            + ".",
            "",
        ]
    return lines


if __name__ == "__main__":
    main()
