"""The OpenAI API as clients use it, through the official `openai` client against a real `fnvllm serve`: fields that
change nothing are accepted and ignored, ``models.retrieve``, ``continuous_usage_stats``, several answers per
request (``n``, ``best_of``, a batch of prompts) sharing their prompt's KV through the prefix cache, and ``echo``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra (fastapi, uvicorn, prometheus-client)")
pytest.importorskip("uvicorn", reason="the server needs the [serve] extra")
pytest.importorskip("prometheus_client", reason="the server needs the [serve] extra")
openai = pytest.importorskip("openai", reason="the server tests drive it with the official openai client")
httpx = pytest.importorskip("httpx", reason="installed with openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import write_family  # noqa: E402

from fnvllm.serve.server_process import ServerProcess  # noqa: E402

MODEL = "tiny"
BLOCK = 8
ENGINE = ["--dtype", "float32", "--device", "cpu", "--block-size", str(BLOCK), "--num-blocks", "512"]
ENGINE += ["--max-model-len", "512", "--attention-backend", "torch", "--served-model-name", MODEL]
PROMPT = "The pure scheduler plans every step"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("serve-openai"), "qwen3")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("serve-openai-log") / "server.log"
    with ServerProcess([str(checkpoint), *ENGINE], log, env=env) as proc:
        yield proc
        assert proc.terminate() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: Any, **kw: Any) -> Any:
    """A completion of PROMPT (greedy, 12 tokens, ignoring EOS unless overridden)."""
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    args["extra_body"] = {"ignore_eos": True, **kw.get("extra_body", {})}
    return client.completions.create(**args)


def hit_tokens(server: ServerProcess) -> float:
    """The prefix cache's hit-token counter from /metrics."""
    text = httpx.get(f"{server.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fnvllm_prefix_cache_hit_tokens_total":
                return sample.value
    raise AssertionError("no fnvllm_prefix_cache_hit_tokens_total in /metrics")


def test_fields_that_change_nothing_are_accepted_and_ignored(client: Any) -> None:
    """store, metadata, service_tier, user, reasoning_effort, parallel_tool_calls, tool_choice "none" and
    response_format text are accepted, and the answer is the same as without them."""
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    tolerant = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, store=False, metadata={"team": "a"},
        service_tier="auto", user="u-1", reasoning_effort="low", parallel_tool_calls=False, tool_choice="none",
        response_format={"type": "text"}, extra_body={"prompt_cache_key": "k", "safety_identifier": "s"},
    )  # fmt: skip
    assert tolerant.choices[0].message.content == plain.choices[0].message.content
    extra = {"store": True, "metadata": {"a": "b"}, "service_tier": "default", "user": "u-2"}
    assert complete(client, extra_body=extra).choices[0].text == complete(client).choices[0].text


def test_models_retrieve_and_the_model_card(client: Any) -> None:
    """models.retrieve finds the served model (its card says max_model_len and vocab_size); another id is a 404."""
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 512 and card.model_extra["vocab_size"] == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_continuous_usage_stats_puts_counts_in_every_chunk(client: Any) -> None:
    """With continuous_usage_stats every chunk carries the usage so far, growing to the final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(complete(client, stream=True, stream_options=options))
    with_choices = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in with_choices]
    assert all(c.usage is not None for c in with_choices) and counts == sorted(counts)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == counts[-1] == 12


def test_n_copies_share_the_prompt_kv_and_draw_their_own_seeds(client: Any, server: ServerProcess) -> None:
    """n=4 returns choices 0-3; greedy copies equal the single answer; seeded copy j equals seed + j alone; the
    copies hit the prefix cache for the prompt's full blocks."""
    prompt = "A prompt nobody sent before, long enough for several KV blocks of eight tokens each: " * 2
    before = hit_tokens(server)
    greedy = complete(client, prompt=prompt, n=4)
    hits = hit_tokens(server) - before
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert {c.text for c in greedy.choices} == {complete(client, prompt=prompt).choices[0].text}
    assert greedy.usage.completion_tokens == 4 * 12
    num_full_blocks = (greedy.usage.prompt_tokens - 1) // BLOCK
    assert greedy.usage.prompt_tokens > 3 * BLOCK and hits >= 3 * num_full_blocks * BLOCK
    sampled = complete(client, n=3, temperature=1.0, seed=11)
    alone = [complete(client, temperature=1.0, seed=11 + j).choices[0].text for j in range(3)]
    assert [c.text for c in sampled.choices] == alone and len(set(alone)) > 1


def test_best_of_returns_the_candidate_with_the_best_mean_logprob(client: Any) -> None:
    """best_of=3, n=1 returns, of the three seeded candidates, the one with the highest mean logprob per token;
    usage counts every candidate's tokens."""
    best = complete(client, temperature=1.0, seed=5, best_of=3)
    candidates = [complete(client, temperature=1.0, seed=5 + j, logprobs=0).choices[0] for j in range(3)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
    assert len(best.choices) == 1 and best.choices[0].text == candidates[means.index(max(means))].text
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 3 * 12


def test_a_batch_of_prompts_with_n_is_prompt_major(client: Any) -> None:
    """A batch of two prompts with n=2 returns four choices: prompt 0's two, then prompt 1's; each equals the
    prompt's own greedy answer; prompt tokens are counted once per prompt."""
    prompts = ["First prompt of the batch", "Second, a different one"]
    got = complete(client, prompt=prompts, n=2)
    single = [complete(client, prompt=p) for p in prompts]
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [single[0].choices[0].text] * 2 + [single[1].choices[0].text] * 2
    assert got.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)


def test_streamed_choices_interleave_and_each_equals_its_answer(client: Any) -> None:
    """A streamed completion with n=2 and a streamed chat with n=2 deliver each choice's text under its index."""
    whole = complete(client).choices[0].text
    texts = ["", ""]
    for chunk in complete(client, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [whole, whole]
    messages = [{"role": "user", "content": "Two answers, please."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**kw).choices[0].message.content
    chat = ["", ""]
    for chunk in client.chat.completions.create(**kw, n=2, stream=True):
        for choice in chunk.choices:
            chat[choice.index] += choice.delta.content or ""
    assert chat == [reply, reply]


def test_echo_prepends_the_prompt(client: Any) -> None:
    """echo returns the prompt followed by the completion, streamed or not."""
    whole = complete(client).choices[0].text
    assert complete(client, echo=True).choices[0].text == PROMPT + whole
    streamed = "".join(c.choices[0].text for c in complete(client, echo=True, stream=True) if c.choices)
    assert streamed == PROMPT + whole


def test_finish_reasons_are_openai_values(client: Any) -> None:
    """Finished choices report "length" or "stop", never an engine-only reason."""
    got = complete(client, n=2, max_tokens=3, extra_body={"ignore_eos": False})
    assert {c.finish_reason for c in got.choices} <= {"stop", "length"}


def test_a_load_generator_shaped_request_streams(server: ServerProcess) -> None:
    """A completions body as guidellm sends it (max_tokens and max_completion_tokens, stop null, ignore_eos,
    include_usage and continuous_usage_stats) streams its tokens with usage, instead of a 400."""
    body = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 7, "max_completion_tokens": 7, "stop": None,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 7 and all("usage" in e for e in events)


def test_chat_template_kwargs_reach_the_template(client: Any, checkpoint: Path) -> None:
    """chat_template_kwargs (vLLM's extension) are passed to the chat template: without the generation prompt the
    conversation is the tokens of "<s>assistant\\n" shorter; an argument the server sets is a 400 naming it."""
    messages = [{"role": "user", "content": "hello"}]

    def prompt_tokens(**extra: Any) -> int:
        args = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
        return client.chat.completions.create(**args, extra_body=extra).usage.prompt_tokens

    opened, closed = prompt_tokens(), prompt_tokens(chat_template_kwargs={"add_generation_prompt": False})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    assert opened - closed == len(tokenizer.encode("<s>assistant\n", add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as refused:
        prompt_tokens(chat_template_kwargs={"tokenize": True})
    assert refused.value.body["param"] == "chat_template_kwargs.tokenize"  # type: ignore[index]
