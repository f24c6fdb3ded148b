"""The command line: generate, chat, serve, run-batch (OpenAI batch files), tokenizer export,
kv-calc, bench, rl."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forklift.bench.cli import add_bench_parser
from forklift.bench.kv_calc import add_kv_calc_parser
from forklift.config import (
    DECODE_BACKENDS,
    QUANTIZATION_METHODS,
    EngineConfig,
)
from forklift.cpu import CPU_KIND_ENV, simulated_cpu_kind, torch_environment
from forklift.rl.cli import add_rl_parser
from forklift.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="HF model dir or GGUF file (default model)")
    group.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_METHODS,
        help="weight-only quantization (default auto: a GGUF file at its own precision on a CPU)",
    )
    group.add_argument(
        "--decode-backend",
        default="auto",
        choices=DECODE_BACKENDS,
        help="quantized decode kernels on a CPU: native C block kernels or torch's "
        "(default auto: native where it builds)",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (methods: ngram, suffix, draft_model with "model" or '
        '"draft_layers", mtp; default off)',
    )
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="let requests run LoRA adapters (PEFT directories) beside the base model",
    )
    group.add_argument("--max-loras", type=int, default=1, help="adapters in one step")
    group.add_argument("--max-lora-rank", type=int, default=16)
    group.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in host memory"
    )
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="how the KV cache stores K/V: auto (bf16 on a CPU unless --dtype is given, else "
        "the model's dtype), bfloat16, float32, int8, fp8 (fp8_e4m3) or fp8_e5m2 (one byte a "
        "value and a scale per token and head: about twice the tokens in the same memory; "
        "int8 the most precise)",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument(
        "--decode-step-prefill-tokens",
        type=int,
        default=None,
        help="most prompt tokens a step prefills while others decode (default: "
        f"{SERVE_DECODE_STEP_PREFILL_TOKENS} for serve with one forward, none otherwise; 0: no "
        "bound beyond --max-num-batched-tokens)",
    )
    group.add_argument(
        "--prefill-pace-steps",
        type=int,
        default=None,
        help="spread pending prompt tokens over about this many decoding steps (within "
        "--decode-step-prefill-tokens, or the token budget without it), so steps cost "
        "alike (default or 0: off)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of earlier requests with the same prefix (default on)",
    )
    group.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one forward for every step: answers never depend on the batch or the cache, "
        "no dense copies of quantized weights (default on; --no-batch-invariant "
        "prefills on the PyTorch layers)",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=None)
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    group.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="exact number of KV-cache blocks (overrides the memory budgets)",
    )
    group.add_argument("--num-threads", type=int, default=None)
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--max-n", type=int, default=128, help="most samples (n) per request")
    group.add_argument(
        "--max-logprobs", type=int, default=20, help="most top logprobs per token a request gets"
    )
    group.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="eager decode; --no-enforce-eager captures it (default: captured on a GPU only)",
    )


# `forklift serve`'s bound on the prompt tokens of a step that decodes, with one forward:
# every step then runs the same native call, whose weights are read once per 256 rows, so
# smaller prefill steps cost no throughput and a prompt no longer waits out other prompts'
# whole prefills (700/100-token chats at c=8: TTFT p50 0.36x, ITL p99 0.22x, output tok/s
# 1.04x of no bound; 128 lost 6% of throughput; docs/serving.md).
SERVE_DECODE_STEP_PREFILL_TOKENS = 256


def serve_engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config `forklift serve` runs: the flags, with serve's prefill bound."""
    config = engine_config_from_args(args)
    if config.decode_step_prefill_tokens is None and config.batch_invariant:
        config = dataclasses.replace(
            config, decode_step_prefill_tokens=SERVE_DECODE_STEP_PREFILL_TOKENS
        )
    return config


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        decode_backend=args.decode_backend,
        batch_invariant=args.batch_invariant,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_step_prefill_tokens=args.decode_step_prefill_tokens,
        prefill_pace_steps=args.prefill_pace_steps,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        num_threads=args.num_threads,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
    )


def add_tool_call_parser_arg(parser: argparse.ArgumentParser) -> None:
    from forklift.server.tools.parsers import PARSERS

    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default="hermes",
        help="how tool calls are read from output and held by grammars (see docs/serving.md)",
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace, **extra: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
        **extra,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from forklift.llm import LLM

    params = sampling_params_from_args(args, n=args.n)
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    tokenizer = llm.get_tokenizer()
    use_chat = not args.raw and tokenizer is not None and tokenizer.chat_template is not None
    if use_chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        for completion in output.outputs:
            if len(args.prompt) > 1 or len(output.outputs) > 1:
                print(f"--- prompt: {prompt!r} [{completion.index}]")
            print(completion.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from forklift.chat_session import run_chat

    engine_config = engine_config_from_args(args)
    return run_chat(engine_config, lambda: sampling_params_from_args(args), args.system)


def cmd_serve(args: argparse.Namespace) -> int:
    from forklift.server.run_server import serve

    lora_modules = parse_lora_modules(args.lora_modules, args.enable_lora)
    if args.data_parallel_size != 1 or args.ray_address is not None:
        from forklift.dp.launch import serve_data_parallel

        if lora_modules:
            raise ValueError("--lora-modules: data-parallel replicas do not load adapters yet")
        if args.batch_dir is not None:
            raise ValueError("--batch-dir: the data-parallel front end runs no batches yet")

        return serve_data_parallel(
            serve_engine_config_from_args(args),
            host=args.host,
            port=args.port,
            data_parallel_size=args.data_parallel_size,
            ray_address=args.ray_address,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            enable_trainer_routes=args.enable_trainer_routes,
            limits=server_limits_from_args(args),
            shutdown_timeout_s=args.shutdown_timeout,
            tool_call_parser=args.tool_call_parser,
        )
    return serve(
        serve_engine_config_from_args(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        limits=server_limits_from_args(args),
        enable_trainer_routes=args.enable_trainer_routes,
        shutdown_timeout_s=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        lora_modules=lora_modules,
        batch_dir=Path(args.batch_dir) if args.batch_dir is not None else None,
    )


def cmd_run_batch(args: argparse.Namespace) -> int:
    from forklift.server.batch.run_batch import run_batch
    from forklift.server.run_server import default_served_name

    summary = run_batch(
        engine_config_from_args(args),
        Path(args.input_file),
        Path(args.output_file),
        served_model_name=args.served_model_name or default_served_name(args.model),
        tool_call_parser=args.tool_call_parser,
        window=args.max_concurrent_requests,
        show_progress=not args.no_progress,
    )
    print(f"{args.output_file}: {summary.line()}", file=sys.stderr)
    return 0


def parse_lora_modules(modules: list[str] | None, enable_lora: bool) -> list[Any]:
    """`name=path` entries as LoRARequests, numbered from 1."""
    from forklift.lora_request import LoRARequest

    if not modules:
        return []
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    requests = []
    for index, entry in enumerate(modules, start=1):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {entry!r} is not name=path")
        requests.append(LoRARequest(name, index, path))
    return requests


def add_server_limit_args(parser: argparse.ArgumentParser) -> None:
    from forklift.server.limits import ServerLimits

    defaults = ServerLimits()
    group = parser.add_argument_group("request limits (each is an HTTP 4xx naming it)")
    group.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    group.add_argument(
        "--max-weights-body-bytes",
        type=int,
        default=defaults.max_weights_body_bytes,
        help="largest POST /v1/weights body (streamed to a temporary file)",
    )
    group.add_argument(
        "--max-file-bytes",
        type=int,
        default=defaults.max_file_bytes,
        help="largest POST /v1/files upload (a batch input file)",
    )
    group.add_argument(
        "--max-prompts-per-request", type=int, default=defaults.max_prompts_per_request
    )


def server_limits_from_args(args: argparse.Namespace) -> Any:
    from forklift.server.limits import ServerLimits

    return ServerLimits(
        max_body_bytes=args.max_body_bytes,
        max_weights_body_bytes=args.max_weights_body_bytes,
        max_file_bytes=args.max_file_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
    )


def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    from forklift.checkpoint.source import resolve_model
    from forklift.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.model))
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to export")
    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory)
    print(f"wrote the tokenizer to {directory}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forklift", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat that streams tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 when this many requests already wait",
    )
    srv.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="independent engine replicas (Ray actors) behind one front end",
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (HEAD:6379) instead of starting a local one",
    )
    add_engine_args(srv)
    add_server_limit_args(srv)
    srv.add_argument(
        "--enable-trainer-routes",
        action="store_true",
        help="serve POST /v1/weights, /pause, /resume, /sleep, /wake_up, /reset_prefix_cache "
        "(needs --api-key unless the host is loopback)",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under their names (needs --enable-lora)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM / SIGINT (then aborted)",
    )
    add_tool_call_parser_arg(srv)
    srv.add_argument(
        "--batch-dir",
        default=None,
        metavar="DIR",
        help="serve /v1/files and /v1/batches, keeping uploads, batch state and results in "
        "DIR (batches left running resume when the server restarts); default off",
    )
    srv.set_defaults(func=cmd_serve)

    batch = sub.add_parser(
        "run-batch",
        help="answer an OpenAI batch file (JSONL) offline; a rerun resumes",
        description="Answer every line of an OpenAI batch input file (custom_id, method, url "
        "/v1/chat/completions or /v1/completions, body) as the server would, all at once "
        "through one engine, appending OpenAI batch output records as answers finish. A "
        "rerun with the same output file skips the custom_ids it already holds.",
    )
    batch.add_argument("-i", "--input-file", required=True, help="the batch input JSONL")
    batch.add_argument("-o", "--output-file", required=True, help="the output JSONL (appended)")
    batch.add_argument(
        "--served-model-name",
        default=None,
        help="the model name request bodies may give (default: the model's name)",
    )
    add_tool_call_parser_arg(batch)
    batch.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="requests in flight at once (default: twice --max-num-seqs)",
    )
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_args(batch)
    batch.set_defaults(func=cmd_run_batch)

    tok = sub.add_parser("tokenizer", help="tokenizer tools")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    export = tok_sub.add_parser("export", help="write tokenizer.json + tokenizer_config.json")
    export.add_argument("directory")
    export.add_argument("--model", default=None)
    export.set_defaults(func=cmd_tokenizer_export)

    add_kv_calc_parser(sub)
    add_bench_parser(sub)
    add_rl_parser(sub)
    return parser


def cap_torch_at_simulated_kind() -> None:
    """Under FORKLIFT_CPU_KIND, torch's kernels take the kind's caps too; set before this
    process runs its first torch kernel (a process that already has gets no caps)."""
    kind = simulated_cpu_kind()
    if kind is None:
        return
    missing = {k: v for k, v in torch_environment(kind).items() if k not in os.environ}
    if missing and "torch" in sys.modules:
        logging.getLogger("forklift").warning(
            "%s=%s: torch was loaded before its caps could be set", CPU_KIND_ENV, kind
        )
    os.environ.update(missing)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        cap_torch_at_simulated_kind()
        return int(args.func(args))
    except ValueError as exc:
        print(f"forklift: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
