"""Talks to a running wgspark server through the official `openai` Python
package: a streamed chat completion, a whole one, and a text completion,
each checked for the shape the package parses (text, finish reason, usage),
and a request for tool calls, refused as the package reports a 400
(`BadRequestError` naming the field).

    python3 -m venv /tmp/oa && /tmp/oa/bin/pip install openai
    cargo run --release --example serve &        # the default model
    /tmp/oa/bin/python scripts/openai_check.py   # --base-url, --api-key
"""
import argparse
import sys

from openai import BadRequestError, OpenAI


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--api-key", default="none")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    pieces = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=32, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    streamed = "".join(pieces)
    print(f"streamed: {streamed!r} ({usage.completion_tokens} tokens)")

    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    text = whole.choices[0].message.content
    print(f"whole:    {text!r} ({whole.choices[0].finish_reason}, {whole.usage.completion_tokens} tokens)")
    assert text == streamed, "streamed and whole replies differ"
    assert whole.usage.completion_tokens == usage.completion_tokens

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    print(f"completion: {completion.choices[0].text!r} ({completion.choices[0].finish_reason})")

    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=8, tools=[tool])
        raise AssertionError("a request for tool calls was answered")
    except BadRequestError as e:
        print(f"tools refused: {e.status_code} {e.body['param']}: {e.body['message']}")
        assert e.body["param"] == "tools"
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
