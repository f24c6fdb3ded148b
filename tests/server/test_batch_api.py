"""/v1/files and /v1/batches through the official openai client: results equal to the same
requests sent alone, errors per line, cancel, the error without --batch-dir, and a server
killed mid-batch that resumes on restart without losing or repeating an answer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from server_harness import free_port, running_server
from test_run_batch import make_tiny_chat_model

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app

ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**21)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-batch-api"))


def chat_line(i: int, max_tokens: int = 4, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"w{3 + i} w{9 + i}"}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def wait_for(client: openai.OpenAI, batch_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.05)


def records(client: openai.OpenAI, file_id: str) -> dict[str, dict]:
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {r["custom_id"]: r for r in lines}
    assert len(by_id) == len(lines), "a line was answered twice"
    return by_id


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=4, **ENGINE))
    batch_dir = tmp_path_factory.mktemp("batch-dir")
    with running_server(build_app(engine, "tiny", batch_dir=batch_dir)) as url:
        yield url


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)


def test_a_batch_answers_as_the_endpoint_does_and_records_bad_lines(client, tmp_path):
    lines = [chat_line(i) for i in range(12)]
    lines.insert(5, "not json")
    lines.insert(8, {"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": "w3"}})  # fmt: skip
    lines.append(chat_line(99, max_tokens=10_000))  # over max_model_len: the endpoint's 400
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == source.stat().st_size
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == source.read_bytes()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "one"})  # fmt: skip
    assert batch.status in ("validating", "in_progress")
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.metadata == {"run": "one"}
    assert done.in_progress_at is not None and done.completed_at is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (15, 12, 3)  # fmt: skip
    answers = records(client, done.output_file_id)
    assert set(answers) == {f"c{i}" for i in range(12)}
    for i in range(12):
        alone = client.chat.completions.create(**chat_line(i)["body"])
        body = answers[f"c{i}"]["response"]["body"]
        assert answers[f"c{i}"]["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert body["usage"]["completion_tokens"] == alone.usage.completion_tokens
    errors = records(client, done.error_file_id)
    assert set(errors) == {None, "wrong-url", "c99"}
    assert errors[None]["response"]["body"]["error"]["message"].startswith("line 6: ")
    assert errors["wrong-url"]["response"]["body"]["error"]["param"] == "url"
    c99 = errors["c99"]["response"]
    assert (
        c99["status_code"] == 400
        and "maximum context length is 128" in c99["body"]["error"]["message"]
    )
    assert done.id in [b.id for b in client.batches.list()]
    listed = {f.id for f in client.files.list()}
    assert {uploaded.id, done.output_file_id, done.error_file_id} <= listed
    with pytest.raises(openai.ConflictError, match="only a running batch"):
        client.batches.cancel(done.id)
    assert client.files.delete(done.error_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done.error_file_id)


def test_cancel_stops_a_running_batch_and_keeps_what_finished(client, tmp_path):
    lines = [chat_line(i, max_tokens=100, ignore_eos=True) for i in range(40)]
    source = write_jsonl(tmp_path / "long.jsonl", lines)
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.02)
    with pytest.raises(openai.ConflictError, match=f"belongs to batch {batch.id}"):
        client.files.delete(uploaded.id)  # the running batch reads it
    assert client.batches.cancel(batch.id).status == "cancelling"
    cancelled = wait_for(client, batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    answers = records(client, cancelled.output_file_id)
    assert 2 <= len(answers) < 40
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 100 for r in answers.values())


def test_bad_creates_and_uploads_are_400s(client, tmp_path):
    with pytest.raises(openai.NotFoundError, match="No such File"):
        client.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions",
                              completion_window="24h")  # fmt: skip
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(0)])
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=source.open("rb"), purpose="fine-tune")
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                              completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="1h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.files.content("../../etc/passwd")
    repeated = write_jsonl(tmp_path / "twice.jsonl", [chat_line(0), chat_line(0)])
    twice = client.files.create(file=repeated.open("rb"), purpose="batch")
    failed = wait_for(
        client,
        client.batches.create(
            input_file_id=twice.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    assert failed.status == "failed"
    assert "custom_id 'c0' is also on line 1" in failed.errors.data[0].message


def test_without_batch_dir_the_endpoints_say_how_to_enable_them(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), **ENGINE))
    with running_server(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for call in (client.files.list, lambda: client.batches.retrieve("batch_x")):
            with pytest.raises(openai.NotFoundError, match="--batch-dir") as caught:
                call()
            assert caught.value.body["code"] == "batches_disabled"


class ServeProcess:
    def __init__(self, model: Path, batch_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "forklift", "serve", "--model", str(model),
                   "--served-model-name", "tiny", "--port", self.url.rsplit(":", 1)[1],
                   "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes",
                   str(2**21), "--max-num-seqs", "4", "--batch-dir", str(batch_dir)]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)  # fmt: skip
        assert "ready at" in self.process.stdout.readline()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process.stdout.close()


def test_a_server_killed_mid_batch_resumes_it_on_restart(tiny_dir, tmp_path):
    batch_dir = tmp_path / "batches"
    lines = [chat_line(i, max_tokens=16, ignore_eos=True) for i in range(12)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    first = ServeProcess(tiny_dir, batch_dir)
    try:
        uploaded = first.client.files.create(file=source.open("rb"), purpose="batch")
        batch = first.client.batches.create(input_file_id=uploaded.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")  # fmt: skip
        while first.client.batches.retrieve(batch.id).request_counts.completed < 2:
            time.sleep(0.02)
    finally:
        first.kill()
    # What the killed server had written: the answers file it was appending to.
    partial = [p for p in (batch_dir / "files").iterdir()
               if p.suffix == "" and p.name != uploaded.id and p.stat().st_size]  # fmt: skip
    assert len(partial) == 1
    written = partial[0].read_text()
    finished_before = written[: written.rfind("\n") + 1]
    assert 2 <= finished_before.count("\n") < 12
    second = ServeProcess(tiny_dir, batch_dir)
    try:
        done = wait_for(second.client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
        output = second.client.files.content(done.output_file_id).text
        assert output.startswith(finished_before)  # nothing finished was lost or rewritten
        answers = records(second.client, done.output_file_id)
        assert set(answers) == {f"c{i}" for i in range(12)}
        for i in (0, 11):
            body = dict(lines[i]["body"])
            extra = {"ignore_eos": body.pop("ignore_eos")}
            alone = second.client.chat.completions.create(**body, extra_body=extra)
            body = answers[f"c{i}"]["response"]["body"]
            assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
    finally:
        second.kill()
