"""The one line `forklift serve` prints once its socket is bound."""

from __future__ import annotations

import json
from typing import TextIO

import uvicorn


def ready_line(host: str, port: int, model_name: str, api_key: str | None) -> str:
    url = f"http://{host}:{port}"
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (
        f"forklift: ready at {url}/v1 (model {model_name}); try: curl {url}/v1/chat/completions"
        f" -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


class AnnouncingServer(uvicorn.Server):
    """Prints the ready line once the socket is bound, not before."""

    def __init__(self, config: uvicorn.Config, line: str, out: TextIO) -> None:
        super().__init__(config)
        self._line = line
        self._out = out

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)
        if self.started:
            print(self._line, file=self._out, flush=True)
