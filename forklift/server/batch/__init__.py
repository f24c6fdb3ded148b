"""OpenAI batch jobs: `forklift run-batch` over a JSONL file, and the server's /v1/files and
/v1/batches. Both run each line through the same endpoint handlers as HTTP requests."""
