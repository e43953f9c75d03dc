"""LLM: offline generation from a Hugging Face checkpoint folder.

    llm = LLM("path/to/Qwen3-0.6B")
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.6, max_tokens=64))
    print(outs[0].text)

The facade owns a tokenizer and an ``EngineLoop`` (the engine, the current EngineState and the output processor);
each call adds its requests with a tracker and steps the loop until they are done.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fnvllm.config import EngineConfig
from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.engine import Engine, EngineLoop, EngineStats, RequestOutput, RequestTracker, StreamDelta
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.executor.tp import TensorParallelExecutor
from fnvllm.model.config import ModelConfig
from fnvllm.state import EngineState, SamplingParams

Prompt = str | Sequence[int]


def read_eos_token_ids(model_path: Path, tokenizer: Any | None) -> frozenset[int]:
    """Every EOS id: generation_config.json's (int or list), else config.json's, plus the tokenizer's."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = model_path / name
        if file.exists():
            value = json.loads(file.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
            if ids:
                break
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class LLM:
    """Offline generation. ``LLM(model_path, **engine_options)``; options are EngineConfig's fields.

    tokenizer: a folder to load the tokenizer from (default: the model folder). load_tokenizer=False skips it
    (token-id prompts only, no text in outputs).
    """

    def __init__(
        self,
        model: str | Path,
        tokenizer: str | Path | None = None,
        load_tokenizer: bool = True,
        **engine_options: Any,
    ) -> None:
        self.config = EngineConfig.from_options(engine_options)
        self.model_path = Path(model)
        if not (self.model_path / "config.json").exists():
            raise FileNotFoundError(f"{self.model_path} is not a checkpoint folder (no config.json)")
        self.tokenizer = _load_tokenizer(tokenizer or self.model_path) if load_tokenizer else None
        self.model_config = ModelConfig.from_pretrained(self.model_path, dtype=self.config.dtype)
        self.executor = _build_executor(self.model_path, self.config, self.model_config)
        core = self.config.core_config(
            self.executor.num_blocks,
            self.model_config.max_position_embeddings,
            read_eos_token_ids(self.model_path, self.tokenizer),
            self.model_config.vocab_size,
        )
        self.engine = Engine(self.executor, core)
        self.loop = EngineLoop(self.engine)
        self._next_id = 0

    def close(self) -> None:
        """Release the executor: with tensor_parallel_size > 1, stop the worker processes (also done when this
        LLM is collected or the interpreter exits). The LLM cannot generate afterwards."""
        self.executor.close()

    def __enter__(self) -> LLM:
        """``with LLM(...) as llm:`` closes it on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the LLM."""
        self.close()

    @property
    def state(self) -> EngineState:
        """The engine's current state (a frozen value: pickle it to snapshot the run)."""
        return self.loop.state

    @property
    def stats(self) -> EngineStats:
        """Totals since this LLM was built: steps, preemptions, prefix-cache tokens, generated tokens."""
        return self.loop.stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); returns outputs in input order."""
        trackers = self._add(prompts, sampling_params, on_delta=_discard)
        bar = tqdm(total=len(trackers), desc="generate", disable=not use_tqdm, unit="req")
        start, num_done = time.perf_counter(), 0
        with self._aborting_on_exit(trackers):
            while num_done < len(trackers):
                self.loop.step()
                done = sum(t.finished for t in trackers)
                if done > num_done:
                    num_tokens = sum(len(t.token_ids) for t in trackers)
                    bar.update(done - num_done)
                    bar.set_postfix(tok_per_s=f"{num_tokens / (time.perf_counter() - start):.0f}")
                    num_done = done
        bar.close()
        return [t.result() for t in trackers]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield each request's new text and ids as steps complete (index = position in ``prompts``).

        Any number of streams may be iterated in turn: each steps the shared engine when it has nothing queued,
        and receives exactly its own requests' deltas (the others' wait in their own queues)."""
        trackers = self._add(prompts, sampling_params)
        with self._aborting_on_exit(trackers):
            while True:
                queued = [t for t in trackers if t.deltas]
                for tracker in queued:
                    while tracker.deltas:
                        yield tracker.deltas.popleft()
                if all(t.finished and not t.deltas for t in trackers):
                    return
                if not queued:
                    self.loop.step()

    @contextlib.contextmanager
    def _aborting_on_exit(self, trackers: list[RequestTracker]) -> Iterator[None]:
        """Abort the trackers' unfinished requests when the block exits early (error, Ctrl-C, a closed stream),
        so they neither run on nor leak into the next call."""
        try:
            yield
        finally:
            for tracker in trackers:
                if not tracker.finished:
                    self.loop.abort(tracker.request_id)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (list of messages) or several, then generate."""
        tokenizer = self._require_tokenizer("chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            tokenizer.apply_chat_template(list(c), tokenize=False, add_generation_prompt=True, **template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer; this LLM was built with load_tokenizer=False")
        return self.tokenizer

    def _encode(self, prompt: Prompt) -> tuple[str | None, tuple[int, ...]]:
        if isinstance(prompt, str):
            return prompt, tuple(self._require_tokenizer("a text prompt").encode(prompt))
        return None, tuple(int(t) for t in prompt)

    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> list[RequestTracker]:
        """Validate and queue every prompt; on any bad input raise before the state changes."""
        items = _as_prompt_list(prompts)
        param_list = _as_params_list(params, len(items))
        trackers = []
        for index, (prompt, p) in enumerate(zip(items, param_list, strict=True)):
            text, ids = self._encode(prompt)
            rid = str(self._next_id + index)
            trackers.append(RequestTracker(index, rid, text, ids, p, self._detokenizer(ids, p), on_delta))
        self.loop.add_many([(t.request_id, t.prompt_ids, t.params, t) for t in trackers])
        self._next_id += len(items)
        return trackers

    def _detokenizer(self, ids: tuple[int, ...], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, ids, True, params.stop, params.include_stop_str_in_output)


def _build_executor(
    model_path: Path, config: EngineConfig, model_config: ModelConfig
) -> ModelExecutor | TensorParallelExecutor:
    """One ModelExecutor, or rank 0 of a tensor-parallel group when tensor_parallel_size > 1."""
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(model_path, config, model_config)
    return ModelExecutor(model_path, config, model_config)


def _load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("prompts must hold at least one prompt")
    if all(isinstance(t, int) for t in items):
        return [items]  # one token-id prompt
    for i, item in enumerate(items):
        if not isinstance(item, str) and not (isinstance(item, Sequence) and all(isinstance(t, int) for t in item)):
            raise TypeError(f"prompts[{i}] must be a str or a sequence of token ids, got {type(item).__name__}")
    return items


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    param_list = list(params)
    if len(param_list) != n:
        raise ValueError(f"sampling_params has {len(param_list)} entries but there are {n} prompts")
    return param_list


def _discard(_: StreamDelta) -> None:
    """``on_delta`` for ``generate``: it returns whole outputs, so deltas need no queue."""
