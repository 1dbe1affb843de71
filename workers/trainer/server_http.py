"""The HTTP session the trainer talks to the inference servers with."""

from __future__ import annotations

import requests


def server_session(api_key: str | None = None) -> requests.Session:
    """A session that sends ``api_key`` (vLLM's ``--api-key``) and drops its pooled
    connections after a server error: a vLLM route that raised (a failed load) ends its
    connection once it has answered, and the next request on it met a reset, which reads
    as a server that went away."""
    session = requests.Session()
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"

    def drop_pool(response: requests.Response, *args: object, **kwargs: object) -> None:
        if response.status_code >= 500:
            response.content  # noqa: B018 - read whole before the pool goes
            session.get_adapter(response.url).close()

    session.hooks["response"].append(drop_pool)
    return session
