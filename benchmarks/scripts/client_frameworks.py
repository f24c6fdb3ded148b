"""Run the agent frameworks, clients and eval harness people build on against a running
`forklift serve`, with each client's defaults, and record which cases work.

The frameworks are not forklift's dependencies: install them beside it in any environment,
start the server, then run this script with that environment's Python:

    pip install langchain-openai openai-agents litellm lm-eval
    forklift serve &
    python benchmarks/scripts/client_frameworks.py --base-url http://127.0.0.1:8000/v1

It writes `client-frameworks.md` and `.json` to `--out` (default `benchmarks/`). Each case
passes when the client call returns without an error and its result has the shape asked
for (text, a tool call, an object of the schema); the model's words are not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

QUESTION = "What is the weather in Paris? Answer briefly."
# Room for a small model's whole answer: a reply cut by max_tokens is an error to the Agents
# SDK (a Responses `incomplete`) and a half-written call to every client.
MAX_TOKENS = 200
AGENT_MAX_TOKENS = 400


class City(BaseModel):
    city: str
    country: str


@dataclass
class CaseResult:
    client: str
    case: str
    passed: bool
    detail: str
    seconds: float


@dataclass
class Target:
    base_url: str
    model: str


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny and 21 C in {city}."


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def langchain_cases(target: Target) -> dict[str, Callable[[], str]]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    def llm(**kwargs: Any) -> ChatOpenAI:
        return ChatOpenAI(base_url=target.base_url, api_key="unused", model=target.model, **kwargs)

    weather = tool(get_weather)

    def invoke() -> str:
        return _text(llm(temperature=0, max_tokens=20).invoke(QUESTION).content)

    def stream() -> str:
        pieces = [c.content for c in llm(temperature=0, max_tokens=20).stream(QUESTION)]
        return _text("".join(str(p) for p in pieces))

    def batch() -> str:
        replies = llm(temperature=0, max_tokens=12).batch([QUESTION, "Say hello."])
        return " | ".join(_text(r.content) for r in replies)

    def forced_tool() -> str:
        bound = llm(temperature=0, max_tokens=MAX_TOKENS).bind_tools(
            [weather], tool_choice="get_weather"
        )
        return _calls(bound.invoke(QUESTION).tool_calls)

    def auto_tool() -> str:
        reply = llm(temperature=0, max_tokens=MAX_TOKENS).bind_tools([weather]).invoke(QUESTION)
        return _calls(reply.tool_calls) if reply.tool_calls else _text(reply.content)

    def structured(method: str) -> Callable[[], str]:
        def run() -> str:
            model = llm(temperature=0, max_tokens=MAX_TOKENS).with_structured_output(
                City, method=method
            )
            answer = model.invoke("Name a city and its country.")
            return _city(answer)

        return run

    def json_mode() -> str:
        # JSON mode promises a JSON object, not the schema's fields: the parsed object is
        # checked, whatever the model put in it.
        model = llm(temperature=0, max_tokens=MAX_TOKENS).with_structured_output(
            City, method="json_mode", include_raw=True
        )
        raw = model.invoke("Name a city and its country, as JSON.")["raw"].content
        if not isinstance(json.loads(raw), dict):
            raise AssertionError(f"not a JSON object: {raw[:40]}")
        return _text(raw)

    def responses_api() -> str:
        reply = llm(temperature=0, max_tokens=20, use_responses_api=True).invoke(QUESTION)
        return _text(reply.text() if callable(getattr(reply, "text", None)) else reply.content)

    return {
        "invoke": invoke,
        "stream": stream,
        "batch": batch,
        "bind_tools, forced": forced_tool,
        "bind_tools, auto": auto_tool,
        "with_structured_output (json_schema)": structured("json_schema"),
        "with_structured_output (function_calling)": structured("function_calling"),
        "with_structured_output (json_mode)": json_mode,
        "use_responses_api": responses_api,
    }


def agents_cases(target: Target) -> dict[str, Callable[[], str]]:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    weather = function_tool(get_weather)

    def model(api: str) -> Any:
        # One client per event loop: each case runs in its own asyncio.run.
        client = AsyncOpenAI(base_url=target.base_url, api_key="unused")
        if api == "responses":
            return OpenAIResponsesModel(target.model, client)
        return OpenAIChatCompletionsModel(target.model, client)

    def agent(api: str, **kwargs: Any) -> Agent:
        settings = ModelSettings(temperature=0, max_tokens=AGENT_MAX_TOKENS)
        if "settings" in kwargs:
            settings = ModelSettings(
                temperature=0, max_tokens=AGENT_MAX_TOKENS, **kwargs.pop("settings")
            )
        return Agent("assistant", model=model(api), model_settings=settings, **kwargs)

    def text(api: str) -> Callable[[], str]:
        async def go() -> str:
            return _text((await Runner.run(agent(api), QUESTION)).final_output)

        return lambda: asyncio.run(go())

    def tool(api: str, **settings: Any) -> Callable[[], str]:
        async def go() -> str:
            result = await Runner.run(
                agent(api, tools=[weather], settings=settings), QUESTION, max_turns=4
            )
            called = [i for i in result.new_items if i.type == "tool_call_item"]
            if settings.get("tool_choice") == "required" and not called:
                raise AssertionError(f"forced, but no call: {str(result.final_output)[:60]}")
            if settings.get("parallel_tool_calls") is False and len(called) > 1:
                raise AssertionError(f"{len(called)} calls with parallel_tool_calls=False")
            return f"{len(called)} call(s); final: {_text(str(result.final_output))}"

        return lambda: asyncio.run(go())

    def output_type(api: str) -> Callable[[], str]:
        async def go() -> str:
            result = await Runner.run(agent(api, output_type=City), "Name a city and its country.")
            return _city(result.final_output)

        return lambda: asyncio.run(go())

    async def streamed() -> str:
        result = Runner.run_streamed(agent("responses"), QUESTION)
        events = [e async for e in result.stream_events()]
        return f"{len(events)} events; final: {_text(str(result.final_output))}"

    async def previous_response() -> str:
        first = await Runner.run(agent("responses"), "My name is Ada.")
        second = await Runner.run(
            agent("responses"), "What is my name?", previous_response_id=first.last_response_id
        )
        return _text(str(second.final_output))

    cases: dict[str, Callable[[], str]] = {}
    for api, label in (("responses", "responses"), ("chat", "chat completions")):
        cases |= {
            f"{label}, text": text(api),
            f"{label}, tool (auto, strict)": tool(api),
            f"{label}, tool forced (required)": tool(api, tool_choice="required"),
            f"{label}, parallel_tool_calls=False": tool(api, parallel_tool_calls=False),
            f"{label}, forced, parallel_tool_calls=False": tool(
                api, tool_choice="required", parallel_tool_calls=False
            ),
            f"{label}, output_type": output_type(api),
        }
    cases["responses, streamed"] = lambda: asyncio.run(streamed())
    cases["responses, previous_response_id"] = lambda: asyncio.run(previous_response())
    return cases


def litellm_cases(target: Target) -> dict[str, Callable[[], str]]:
    import litellm

    common = {
        "model": f"openai/{target.model}",
        "api_base": target.base_url,
        "api_key": "unused",
        "temperature": 0,
    }
    ask = [{"role": "user", "content": QUESTION}]

    def completion() -> str:
        reply = litellm.completion(messages=ask, max_tokens=20, **common)
        return _text(reply.choices[0].message.content)

    def stream() -> str:
        chunks = litellm.completion(messages=ask, max_tokens=20, stream=True, **common)
        return _text("".join(c.choices[0].delta.content or "" for c in chunks))

    def tools(choice: Any) -> Callable[[], str]:
        def go() -> str:
            reply = litellm.completion(
                messages=ask,
                max_tokens=MAX_TOKENS,
                tools=[WEATHER_TOOL],
                tool_choice=choice,
                **common,
            )
            message = reply.choices[0].message
            if message.tool_calls:
                return _calls(
                    [
                        {"name": c.function.name, "args": json.loads(c.function.arguments)}
                        for c in message.tool_calls
                    ]
                )
            return _text(message.content)

        return go

    def schema() -> str:
        reply = litellm.completion(
            messages=[{"role": "user", "content": "Name a city and its country."}],
            max_tokens=MAX_TOKENS,
            response_format=City,
            **common,
        )
        return _city(City.model_validate_json(reply.choices[0].message.content))

    def batch() -> str:
        replies = litellm.batch_completion(
            messages=[ask, [{"role": "user", "content": "Say hello."}]], max_tokens=12, **common
        )
        return " | ".join(_text(r.choices[0].message.content) for r in replies)

    def responses() -> str:
        reply = litellm.responses(
            model=common["model"],
            api_base=target.base_url,
            api_key="unused",
            input=QUESTION,
            max_output_tokens=20,
            temperature=0,
        )
        return _text(reply.output[0].content[0].text)

    forced = {"type": "function", "function": {"name": "get_weather"}}
    return {
        "completion": completion,
        "stream": stream,
        "batch_completion": batch,
        "tools, forced": tools(forced),
        "tools, auto": tools("auto"),
        "response_format (pydantic)": schema,
        "responses": responses,
    }


def lm_eval_cases(target: Target) -> dict[str, Callable[[], str]]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # The harness's own tokenizer through the server (no tokenizer directory): it reads
    # /tokenizer_info, then tokenizes with /tokenize and /detokenize.
    lm = LocalCompletionsAPI(
        model=target.model,
        base_url=target.base_url + "/completions",
        tokenizer_backend="remote",
        num_concurrent=1,
    )

    def loglikelihood() -> str:
        context = "The capital of France is"
        paris, berlin = lm.loglikelihood(
            [
                Instance("loglikelihood", {}, (context, " Paris"), 0),
                Instance("loglikelihood", {}, (context, " Berlin"), 1),
            ]
        )
        if not paris[0] > berlin[0]:
            raise AssertionError(f"Paris {paris[0]:.2f} not above Berlin {berlin[0]:.2f}")
        return f"Paris {paris[0]:.2f} (greedy {paris[1]}), Berlin {berlin[0]:.2f}"

    def generate_until() -> str:
        request = ("Q: What is 2+2?\nA:", {"until": ["\n"], "max_gen_toks": 10})
        return _text(lm.generate_until([Instance("generate_until", {}, request, 0)])[0])

    def rolling() -> str:
        text = ("Paris is the capital of France.",)
        (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, text, 0)])
        return f"{total:.2f} nats"

    return {
        "local-completions, remote tokenizer: loglikelihood": loglikelihood,
        "local-completions, remote tokenizer: generate_until": generate_until,
        "local-completions, remote tokenizer: loglikelihood_rolling": rolling,
    }


def _text(value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise AssertionError("empty answer")
    return text[:60]


def _calls(calls: list[dict[str, Any]]) -> str:
    if not calls:
        raise AssertionError("no tool call")
    return "; ".join(f"{c['name']}({json.dumps(c['args'])})" for c in calls)[:80]


def _city(answer: Any) -> str:
    city = City.model_validate(answer if isinstance(answer, dict) else answer.model_dump())
    return f"{city.city}, {city.country}"[:60]


CLIENTS = {
    "langchain": langchain_cases,
    "agents-sdk": agents_cases,
    "litellm": litellm_cases,
    "lm-eval": lm_eval_cases,
}
PACKAGES = {
    "langchain": "langchain-openai",
    "agents-sdk": "openai-agents",
    "litellm": "litellm",
    "lm-eval": "lm_eval",
}


def run_cases(target: Target, clients: list[str]) -> list[CaseResult]:
    results = []
    for client in clients:
        for case, call in CLIENTS[client](target).items():
            start = time.perf_counter()
            try:
                detail, passed = call(), True
            except Exception as exc:  # a failing case is a result, not a crash
                detail, passed = _failure(exc), False
            results.append(CaseResult(client, case, passed, detail, time.perf_counter() - start))
            print(f"{'ok ' if passed else 'FAIL'} {client}: {case}: {detail}", flush=True)
    return results


def _failure(exc: Exception) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last.replace("\n", " ")[:160]


def write_report(results: list[CaseResult], out: Path, target: Target, command: str) -> None:
    versions = {c: metadata.version(PACKAGES[c]) for c in {r.client for r in results}}
    passed = sum(r.passed for r in results)
    lines = [
        "# Client frameworks against `forklift serve`",
        "",
        f"Model `{target.model}`; each client with its defaults, temperature 0. "
        f"**{passed} of {len(results)} cases work.**",
        "",
        "Versions: "
        + ", ".join(f"{PACKAGES[c]} {v}" for c, v in sorted(versions.items()))
        + f"; Python {platform.python_version()}.",
        "",
        "| client | case | works | what came back |",
        "|---|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.client} | {r.case} | {'yes' if r.passed else 'NO'} | {detail} |")
    lines += ["", f"CPU flags: {_cpu_flags()}", "", f"Command: `{command}`", ""]
    (out / "client-frameworks.md").write_text("\n".join(lines))
    record = {"versions": versions, "results": [asdict(r) for r in results]}
    (out / "client-frameworks.json").write_text(json.dumps(record, indent=1) + "\n")


def _cpu_flags() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if "Flags" in line), []
    )
    return " ".join(f for f in flags if f.startswith(("avx", "amx", "fma")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = parser.parse_args()
    model = args.model or _served_model(args.base_url)
    target = Target(args.base_url, model)
    results = run_cases(target, args.clients)
    command = "python benchmarks/scripts/client_frameworks.py " + " ".join(
        ["--clients", *args.clients]
    )
    write_report(results, args.out, target, command)


def _served_model(base_url: str) -> str:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id


if __name__ == "__main__":
    main()
