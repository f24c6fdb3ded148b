"""`forklift run-batch`: an OpenAI batch file answered as the server answers each line, bad
lines recorded one by one, and a rerun that resumes a torn output file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from forklift import LLM, SamplingParams
from forklift.server.batch.output_file import read_finished
from forklift.server.batch.records import read_batch

# Joins the messages' contents: the word-level tiny tokenizer reads it as the words given.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
MODEL_FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128",
               "--kv-cache-memory-bytes", str(2**21)]  # fmt: skip
MALFORMED = [
    "{this is not json",
    json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
    json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "w4", "max_tokens": "many"}}),  # fmt: skip
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "w4"}}),
    json.dumps({"custom_id": "bad-sampling", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "w5"}], "temperature": -1}}),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-batch"))


def make_tiny_chat_model(directory: Path) -> Path:
    """A tiny random Llama whose tokenizer has a plain chat template."""
    make_tiny_model("llama", directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


def valid_line(i: int) -> dict:
    words = " ".join(f"w{3 + (i * 7 + k) % 200}" for k in range(1 + i % 5))
    if i % 2:
        body = {"model": "tiny", "messages": [{"role": "user", "content": words}],
                "max_tokens": 3 + i % 4, "temperature": 0}  # fmt: skip
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": body}  # fmt: skip
    body = {"prompt": words, "max_tokens": 2 + i % 5, "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> Path:
    lines = [json.dumps(valid_line(i)) for i in range(195)]
    for position, bad in zip((0, 40, 99, 150, 197), MALFORMED, strict=True):
        lines.insert(position, bad)
    path = tmp_path_factory.mktemp("batch-in") / "input.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_batch(model: Path, source: Path, output: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "forklift", "run-batch", "-i", str(source), "-o",
               str(output), "--model", str(model), *MODEL_FLAGS]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def records_by_key(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [r["custom_id"] or r["response"]["body"]["error"]["message"] for r in records]
    assert len(keys) == len(set(keys)), "a line was answered twice"
    return dict(zip(keys, records, strict=True))


@pytest.fixture(scope="module")
def first_run(tiny_chat_model, batch_file, tmp_path_factory) -> tuple[Path, str]:
    output = tmp_path_factory.mktemp("batch-out") / "output.jsonl"
    result = run_batch(tiny_chat_model, batch_file, output)
    return output, result.stderr


@pytest.mark.slow
def test_every_line_answered_as_alone_and_bad_lines_recorded(
    first_run, batch_file, tiny_chat_model
):
    output, stderr = first_run
    records = records_by_key(output)
    assert len(records) == 200
    failed = {k: r for k, r in records.items() if r["response"]["status_code"] != 200}
    assert len(failed) == 5
    for record in failed.values():
        assert record["response"]["status_code"] == 400
        assert set(record["response"]["body"]["error"]) == {"message", "type", "param", "code"}
        assert record["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert failed["bad-url"]["response"]["body"]["error"]["param"] == "url"
    assert failed["bad-body"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert failed["bad-sampling"]["response"]["body"]["error"]["param"] == "temperature"
    unnamed = [k for k in failed if k.startswith("line ")]
    assert sorted(int(k.split(":")[0].split()[1]) for k in unnamed) == [1, 151]
    # Each answer equals the same request run alone, greedy, by the offline LLM.
    llm = LLM(model=str(tiny_chat_model), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=2**21)  # fmt: skip
    for i in range(195):
        line = valid_line(i)
        body = records[line["custom_id"]]["response"]["body"]
        params = SamplingParams(temperature=0, max_tokens=line["body"]["max_tokens"])
        if "messages" in line["body"]:
            alone = llm.chat(line["body"]["messages"], params, use_tqdm=False)[0]
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["content"] == alone.outputs[0].text
        else:
            alone = llm.generate(line["body"]["prompt"], params, use_tqdm=False)[0]
            assert body["object"] == "text_completion"
            assert body["choices"][0]["text"] == alone.outputs[0].text
        assert body["choices"][0]["finish_reason"] == alone.outputs[0].finish_reason
        assert body["usage"]["completion_tokens"] == len(alone.outputs[0].token_ids)
    assert "Batch requests" in stderr and "tok/s" in stderr
    assert "195 answered, 5 failed, 0 already done (of 200)" in stderr


@pytest.mark.slow
def test_rerun_resumes_a_torn_output_without_duplicates(first_run, batch_file, tiny_chat_model):
    complete, _ = first_run
    lines = complete.read_text().splitlines(keepends=True)
    seeded = complete.with_name("seeded.jsonl")
    kept = "".join(lines[:60])
    # The 61st line half written, as a run killed mid-write leaves it.
    seeded.write_text(kept + lines[60][: len(lines[60]) // 2])
    result = run_batch(tiny_chat_model, batch_file, seeded)
    assert "already done (of 200)" in result.stderr
    assert "60 already done" in result.stderr
    assert seeded.read_text().startswith(kept)  # finished lines never rewritten
    resumed, original = records_by_key(seeded), records_by_key(complete)
    assert resumed.keys() == original.keys()
    for key, record in original.items():
        assert resumed[key]["response"]["status_code"] == record["response"]["status_code"]
        if record["response"]["status_code"] == 200:
            choice = record["response"]["body"]["choices"][0]
            assert resumed[key]["response"]["body"]["choices"][0] == choice
    # A third run finds everything done and loads no model.
    again = run_batch(tiny_chat_model, batch_file, seeded)
    assert "0 answered, 0 failed, 200 already done" in again.stderr
    assert seeded.read_text().count("\n") == 200


def test_repeated_custom_id_is_refused_before_any_work(tmp_path, tiny_chat_model):
    line = json.dumps(valid_line(0))
    source = tmp_path / "input.jsonl"
    source.write_text(f"{line}\n{json.dumps(valid_line(2))}\n{line}\n")
    with pytest.raises(ValueError, match=r"line 3: custom_id 'req-0' is also on line 1"):
        read_batch(source.read_text().splitlines())
    command = [sys.executable, "-m", "forklift", "run-batch", "-i", str(source), "-o",
               str(tmp_path / "out.jsonl"), "--model", str(tiny_chat_model)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "also on line 1" in result.stderr


def test_an_output_file_that_is_not_batch_records_is_refused(tmp_path):
    output = tmp_path / "output.jsonl"
    output.write_text('{"custom_id": "a", "response": null}\n{"something": "else"}\n')
    with pytest.raises(ValueError, match="line 2 is not a batch output record"):
        read_finished(output)
