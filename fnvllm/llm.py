"""LLM: offline generation from a Hugging Face checkpoint folder.

    llm = LLM("path/to/Qwen3-0.6B")
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.6, max_tokens=64))
    print(outs[0].text)

The facade owns a tokenizer, an Engine and the current EngineState; each call threads the state through the
pure ``schedule``/``commit`` loop and applies what needs text (stop strings) through incremental detokenizers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm.auto import tqdm

from fnvllm.config import EngineConfig
from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.engine import Engine, EngineOutput
from fnvllm.executor.base import TokenLogprobs
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.model.config import ModelConfig
from fnvllm.state import EngineState, FinishReason, SamplingParams, StepPlan, add_request, finish, schedule

Prompt = str | Sequence[int]


@attrs.frozen
class RequestOutput:
    """The result of one prompt.

    request_id: engine-wide id. prompt: the text prompt (None for token-id prompts). prompt_token_ids: its ids.
    text: generated text (stop string excluded unless include_stop_str_in_output; special tokens skipped).
    token_ids: generated ids (including an EOS or stop token that ended it). finish_reason: "stop" or "length".
    logprobs: one entry per generated token when SamplingParams.logprobs was set, else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        """True once the request ended (always, for ``generate`` results)."""
        return self.finish_reason is not None


@attrs.frozen
class EngineStats:
    """Running totals since the LLM was built: steps run, sequences preempted, prompt tokens served from the
    prefix cache (not recomputed), and tokens generated."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0


@attrs.frozen
class StreamDelta:
    """What one step added to one request: the index of its prompt, new text and ids, and its finish reason."""

    index: int
    request_id: str
    new_text: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


class _Tracker:
    """Host-side progress of one request: its ids, logprobs and detokenizer."""

    def __init__(
        self,
        index: int,
        rid: str,
        prompt: str | None,
        ids: tuple[int, ...],
        params: SamplingParams,
        detok: IncrementalDetokenizer | None,
    ) -> None:
        self.index, self.rid, self.prompt, self.prompt_ids, self.params = index, rid, prompt, ids, params
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: FinishReason | None = None

    def add(self, token: int, logprobs: TokenLogprobs | None) -> str:
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detok is None:
            return ""
        delta = self.detok.add([token])
        if delta.stopped:
            self.finish_reason = "stop"
        return delta.new_text

    def close(self, reason: FinishReason) -> str:
        if self.finish_reason is None:
            self.finish_reason = reason
        return self.detok.finish().new_text if self.detok is not None else ""

    def result(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.rid,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            text=self.detok.text if self.detok is not None else "",
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            logprobs=tuple(self.logprobs) if self.params.logprobs is not None else None,
        )


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
        self.executor = ModelExecutor(self.model_path, self.config, self.model_config)
        core = self.config.core_config(
            self.executor.num_blocks,
            self.model_config.max_position_embeddings,
            read_eos_token_ids(self.model_path, self.tokenizer),
            self.model_config.vocab_size,
        )
        self.engine = Engine(self.executor, core)
        self.state: EngineState = self.engine.initial_state()
        self.stats = EngineStats()
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); returns outputs in input order."""
        trackers = self._add(prompts, sampling_params)
        bar = tqdm(total=len(trackers), desc="generate", disable=not use_tqdm, unit="req")
        start, num_tokens = time.perf_counter(), 0
        for deltas in self._run(trackers):
            num_tokens += sum(len(d.new_token_ids) for d in deltas)
            done = sum(1 for d in deltas if d.finish_reason is not None)
            if done:
                bar.update(done)
                bar.set_postfix(tok_per_s=f"{num_tokens / (time.perf_counter() - start):.0f}")
        bar.close()
        return [t.result() for t in trackers]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield each request's new text and ids as steps complete (index = position in ``prompts``)."""
        for deltas in self._run(self._add(prompts, sampling_params)):
            yield from deltas

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
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[_Tracker]:
        """Validate and queue every prompt; on any bad input raise before the state changes."""
        items = _as_prompt_list(prompts)
        param_list = _as_params_list(params, len(items))
        state, trackers = self.state, []
        for index, (prompt, p) in enumerate(zip(items, param_list, strict=True)):
            text, ids = self._encode(prompt)
            rid = str(self._next_id + index)
            state = add_request(state, rid, ids, p)
            trackers.append(_Tracker(index, rid, text, ids, p, self._detokenizer(ids, p)))
        self.state, self._next_id = state, self._next_id + len(items)
        return trackers

    def _detokenizer(self, ids: tuple[int, ...], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, ids, True, params.stop, params.include_stop_str_in_output)

    def _run(self, trackers: list[_Tracker]) -> Iterator[list[StreamDelta]]:
        """Step until every tracked request finished, yielding each step's deltas."""
        by_id = {t.rid: t for t in trackers}
        live = set(by_id)
        try:
            while live:
                waiting_before = self.state.waiting
                state, plan = schedule(self.state)
                self._count(plan, waiting_before, state.waiting)
                state, out = self.engine.step(state, plan)
                state, deltas = self._apply(state, out, by_id, live)
                self.state = state
                yield deltas
        except BaseException:
            self.state = self.engine.restore(self.engine.initial_state())  # executor and state in step again
            raise

    def _count(self, plan: StepPlan, waiting_before: tuple[str, ...], waiting_after: tuple[str, ...]) -> None:
        """Fold one plan into ``stats`` (admitted rows' start positions are the tokens the prefix cache served).

        ``schedule`` hands back the same waiting tuple when it admits and preempts nothing, so most decode steps
        skip the O(waiting) set work."""
        cached = 0
        if waiting_after is not waiting_before:
            admitted = set(waiting_before).difference(waiting_after)
            starts = zip(plan.seq_ids, plan.start_positions, strict=True)
            cached = sum(start for rid, start in starts if rid in admitted)
        s = self.stats
        self.stats = EngineStats(
            s.num_steps + 1,
            s.num_preemptions + len(plan.preempted),
            s.num_cached_tokens + cached,
            s.num_generated_tokens + plan.num_samples,
        )

    def _apply(
        self, state: EngineState, out: EngineOutput, by_id: dict[str, _Tracker], live: set[str]
    ) -> tuple[EngineState, list[StreamDelta]]:
        finished = {f.request_id: f.reason for f in out.output.finished}
        deltas = []
        for rid, token in zip(out.output.seq_ids, out.output.new_tokens, strict=True):
            tracker = by_id.get(rid)
            if tracker is None or rid not in live:
                continue
            text = tracker.add(token, out.logprobs.get(rid))
            if tracker.finish_reason == "stop" and rid not in finished:
                state = finish(state, rid)  # a stop string ended it; the core only knows token-level stops
                finished[rid] = "stop"
            if rid in finished:
                text += tracker.close(finished[rid])
                live.discard(rid)
            deltas.append(StreamDelta(tracker.index, rid, text, (token,), tracker.finish_reason))
        return state, deltas


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
