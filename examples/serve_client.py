"""Talk to a running `fnvllm serve` with the official OpenAI client (pip install 'fnvllm[serve]' openai).

fnvllm serve --port 8000 &          # the embedded demo model (or: fnvllm serve path/to/Qwen3-0.6B)
python examples/serve_client.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    """One completion, two sampled answers to one prompt (n=2), one streamed chat."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id

    completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=48, temperature=0)
    print(f"completion ({completion.usage.completion_tokens} tokens): {completion.choices[0].text!r}")

    two = client.completions.create(model=model, prompt="A name for a cat:", max_tokens=8, n=2, seed=1)
    for choice in two.choices:  # the copies share the prompt's KV blocks through the prefix cache
        print(f"answer {choice.index}: {choice.text!r}")

    messages = [{"role": "user", "content": "Write a haiku about paged attention."}]
    print("chat: ", end="", flush=True)
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=48, stream=True):
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
