"""The real `openai` client, run inside a lab namespace by tests/test_lab_openai.py.

    OPENAI_API_KEY=<key> python tests/helpers/lab_openai_client.py BASE_URL MODEL THINK_SECONDS [CA_FILE]

Streams one chat completion (usage included, a thinking pause), asks for one plain completion,
lists the models and asks for a model nobody serves; prints what the client made of each as one
JSON document. The client is given BASE_URL, its key (OPENAI_API_KEY, the client's own variable,
so that the key is in no command line) and the CA to trust for an https BASE_URL; nothing else
(no retries, no other environment).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time

import openai

MAX_TOKENS = 6


def main(base_url: str, model: str, think: str, ca_file: str | None = None) -> dict:
    http_client = None
    if ca_file:
        # Only the lab's CA: the system's roots could not vouch for the lab's load balancer.
        http_client = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca_file))
    client = openai.OpenAI(
        base_url=base_url,
        api_key=os.environ.get("OPENAI_API_KEY") or "no-key",
        max_retries=0,
        timeout=30,
        http_client=http_client,
    )
    messages = [{"role": "user", "content": "how many nodes answer this prompt"}]
    report: dict = {"openai": openai.__version__}

    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=MAX_TOKENS,
        extra_headers={"X-Lab-Think": think},
    )
    report["stream"] = [
        {"at": time.monotonic() - started, "chunk": chunk.model_dump(mode="json")} for chunk in stream
    ]

    plain = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=MAX_TOKENS)
    report["plain"] = plain.model_dump(mode="json")

    report["models"] = [card.model_dump(mode="json") for card in client.models.list()]

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        report["unknown_model"] = {"raised": None}
    except openai.APIStatusError as error:
        report["unknown_model"] = {
            "raised": type(error).__name__,
            "status": error.status_code,
            "message": error.message,
        }
    return report


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
