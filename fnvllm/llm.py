"""LLM: offline generation from a Hugging Face checkpoint folder.

    llm = LLM("path/to/Qwen3-0.6B")
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.6, max_tokens=64))
    print(outs[0].text)

    for out in llm.generate(["def fib("], SamplingParams(n=3, temperature=0.8, seed=1)):
        for completion in out.outputs:  # n completions per prompt
            print(completion.index, completion.text, completion.finish_reason)

The facade is a thin client of the composition root (``fnvllm.engine.build.build_engine``), which assembles the
tokenizer, the executor and the ``EngineLoop`` (the engine, the current EngineState and the output processor);
each call adds its requests with a tracker and steps the loop until they are done. A prompt whose
``SamplingParams.n`` is above 1 runs as n engine requests (``fnvllm.state.copies``: copy j of a seeded request
draws from seed + j), queued side by side so the prefix cache computes the prompt once; ``generate`` joins them
into one RequestOutput (``group_outputs``), ``stream`` labels each delta with its ``completion``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter, countOf
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fnvllm.config import EngineConfig
from fnvllm.engine import EngineStats, RequestOutput, RequestTracker, StreamDelta, group_outputs
from fnvllm.engine.beam import BeamSearchOutput, BeamSearchParams, beam_search
from fnvllm.engine.build import build_engine
from fnvllm.engine.output import discard_delta
from fnvllm.engine.text import render_chat, resolve_bad_words
from fnvllm.state import EngineState, InvalidRequestError, SamplingParams, copies
from fnvllm.state.checks import CONFIG, REQUEST, check_bool, check_token_ids, show
from fnvllm.state.errors import RequestTypeError
from fnvllm.state.params import truncate_prompt
from fnvllm.state.request import check_request

_FINISH_REASON = attrgetter("finish_reason")  # a tracker's; None while it runs

Prompt = str | Sequence[int]
Encoded = tuple[str | None, tuple[int, ...]]  # (text or None for token-id prompts, token ids)
Conversation = Sequence[Mapping[str, str]]


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
        config = EngineConfig.from_options(engine_options)
        check_bool(load_tokenizer, "load_tokenizer", CONFIG)
        self.parts = build_engine(model, config, tokenizer, load_tokenizer)
        self.config, self.model_path, self.model_config = config, self.parts.model_path, self.parts.model_config
        self.tokenizer, self.executor, self.engine = self.parts.tokenizer, self.parts.executor, self.parts.engine
        self.loop = self.parts.loop
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
        """Generate for each prompt (text or token ids); returns one RequestOutput per prompt, in input order.

        ``prompts``: one str, one token-id sequence (a list, tuple or 1-D integer array), or a sequence of those.
        ``sampling_params``: one SamplingParams for all, or one per prompt. A prompt's ``SamplingParams.n``
        completions are its output's ``outputs`` (index 0 .. n-1; the flat fields are completion 0's). Any bad
        argument raises InvalidRequestError (RequestTypeError for a wrong type, also a TypeError) naming it,
        before anything is queued. The progress bar counts sequences: n per prompt."""
        check_bool(use_tqdm, "use_tqdm", REQUEST)
        return self._generate(self._encode_all(prompts), sampling_params, use_tqdm)

    def _generate(
        self, encoded: list[Encoded], params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool
    ) -> list[RequestOutput]:
        encoded, param_list = _with_params(encoded, params)
        groups = self._add(encoded, param_list, on_delta=discard_delta)  # no deltas
        trackers = [tracker for group in groups for tracker in group]
        bar = tqdm(total=len(trackers), desc="generate", disable=not use_tqdm, unit="req")
        start, pending = time.perf_counter(), trackers
        with self._aborting_on_exit(trackers):
            while pending:  # per step: one C-level count over the unfinished trackers (a list pruned as they end)
                self.loop.step()
                still = countOf(map(_FINISH_REASON, pending), None)
                if still < len(pending):
                    bar.update(len(pending) - still)
                    pending = [t for t in pending if t.finish_reason is None]
                    if use_tqdm:
                        num_tokens = sum(len(t.token_ids) for t in trackers)
                        bar.set_postfix(tok_per_s=f"{num_tokens / (time.perf_counter() - start):.0f}")
        bar.close()
        return [group_outputs([t.result() for t in group]) for group in groups]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield each request's new text and ids as steps complete (index = position in ``prompts``; completion =
        which of its ``SamplingParams.n`` completions, 0 .. n-1: each (index, completion) pair is one sequence).

        Any number of streams may be iterated in turn: each steps the shared engine when it has nothing queued,
        and receives exactly its own requests' deltas (the others' wait in their own queues). Arguments are
        checked (and the requests queued) when this is called, not when iteration starts."""
        encoded, param_list = _with_params(self._encode_all(prompts), sampling_params)
        for index, ((_, ids), params) in enumerate(zip(encoded, param_list, strict=True)):
            try:  # what can be checked now is checked now; the requests are queued when iteration starts
                check_request(self.engine.config, (), "stream", ids, copies(params, 1)[0])  # as each copy is
            except InvalidRequestError as e:
                raise type(e)(f"prompts[{index}]: {e}") from None
        return self._stream(encoded, param_list)

    def _stream(self, encoded: list[Encoded], param_list: list[SamplingParams]) -> Iterator[StreamDelta]:
        trackers = [tracker for group in self._add(encoded, param_list) for tracker in group]
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
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (list of messages) or several, then generate
        (one RequestOutput per conversation, with ``SamplingParams.n`` completions each, as ``generate``).

        Each message is a mapping with str "role" and "content". The templated text is encoded without adding
        special tokens: the template writes its own (a BOS added on top would be a second one)."""
        check_bool(use_tqdm, "use_tqdm", REQUEST)
        conversations = _as_conversations(messages)
        encoded = [self.encode_chat(c, **template_kwargs) for c in conversations]
        return self._generate(encoded, sampling_params, use_tqdm)

    def encode_chat(self, conversation: Conversation, **template_kwargs: Any) -> Encoded:
        """(templated text, its token ids) of one conversation with the assistant's turn opened."""
        tokenizer = self._require_tokenizer("chat")
        _check_conversation(conversation, "messages")
        text = render_chat(tokenizer, conversation, **template_kwargs)
        return text, self._encode_text(text, "messages", add_special_tokens=False)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer; this LLM was built with load_tokenizer=False")
        return self.tokenizer

    def _encode_text(self, text: str, name: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """The tokenizer's ids for ``text``; text it cannot encode (lone surrogates) is an InvalidRequestError."""
        tokenizer = self._require_tokenizer(f"{name}: a text prompt")
        try:
            return tuple(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"{name}: the tokenizer cannot encode {show(text)}: {e}") from None

    def _encode_all(self, prompts: Prompt | Sequence[Prompt]) -> list[Encoded]:
        """Every prompt as (text or None, token ids), each id checked against the vocabulary."""
        vocab = self.engine.config.vocab_size
        encoded: list[Encoded] = []
        for index, prompt in enumerate(_as_prompt_list(prompts)):
            name = f"prompts[{index}]"
            if isinstance(prompt, str):
                encoded.append((prompt, self._encode_text(prompt, name)))
            else:
                encoded.append((None, check_token_ids(prompt, name, REQUEST, vocab)))
        return encoded

    def _add(
        self,
        encoded: list[Encoded],
        param_list: list[SamplingParams],
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> list[list[RequestTracker]]:
        """Queue every prompt as ``SamplingParams.n`` copies (``copies``), side by side, its bad_words resolved to
        ids (``resolve_bad_words``); returns each prompt's trackers in completion order. Validated by the core: on
        any bad input raise before the state changes."""
        groups: list[list[RequestTracker]] = []
        next_id = self._next_id
        distinct = {id(p): p for p in param_list}  # one SamplingParams object is often shared by every prompt
        resolved = {key: resolve_bad_words(self.tokenizer, p) for key, p in distinct.items()}
        for index, ((text, ids), given) in enumerate(zip(encoded, param_list, strict=True)):
            params = resolved[id(given)]
            groups.append(self._copies(index, (text, ids), params, next_id, on_delta))
            next_id += params.n
        self.loop.add_many([(t.request_id, t.prompt_ids, t.params, t) for group in groups for t in group])
        self._next_id = next_id
        return groups

    def _copies(
        self, index: int, prompt: Encoded, params: SamplingParams, first_id: int, on_delta: Callable[..., None] | None
    ) -> list[RequestTracker]:
        """The trackers of prompt ``index``'s ``params.n`` copies, with request ids first_id, first_id + 1, ..."""
        text, ids = prompt
        detokenizer = self.parts.detokenizer
        return [
            RequestTracker(index, str(first_id + j), text, ids, p, detokenizer(ids, p), on_delta, completion=j)
            for j, p in enumerate(copies(params, params.n))
        ]

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``): one BeamSearchOutput per prompt, in input order, holding up to
        ``params.beam_width`` sequences, best first. ``prompts`` as ``generate`` takes them. Every step runs all
        beams of all prompts as one batch of one-token requests (``fnvllm.engine.beam``, which gives the rules).
        The progress bar counts search steps."""
        check_bool(use_tqdm, "use_tqdm", REQUEST)
        encoded = self._encode_all(prompts)
        search, self._next_id = self._next_id, self._next_id + 1  # its requests: beam<search>-<step>-<row>
        return beam_search(self.loop, encoded, params, f"beam{search}", self.tokenizer, use_tqdm)


def _as_prompt_list(prompts: object) -> list[Any]:
    """One prompt or a sequence of them, as a list. One prompt: a str, a sequence of ints, a 1-D integer array.
    Anything else (bytes, a dict, a set, a float) is a RequestTypeError naming it."""
    if isinstance(prompts, str):
        return [prompts]
    ndim = getattr(prompts, "ndim", None)
    if ndim is not None and getattr(prompts, "dtype", None) is not None:
        if ndim == 1:
            return [prompts]
        if ndim == 2:
            rows: list[Any] = list(prompts)  # type: ignore[call-overload]
            return rows
    if isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Sequence):
        raise RequestTypeError(
            f"prompts must be a str, a sequence of token ids, or a list of those, got {show(prompts)}"
        )
    items = list(prompts)
    if not items:
        raise InvalidRequestError("prompts must hold at least one prompt")
    if not any(isinstance(t, (str, Sequence)) or getattr(t, "ndim", 0) for t in items):
        return [prompts]  # one token-id prompt (its ids are checked with the others)
    for i, item in enumerate(items):
        is_ids = getattr(item, "ndim", None) == 1 or (isinstance(item, Sequence) and not isinstance(item, bytes))
        if not (isinstance(item, str) or is_ids):
            raise RequestTypeError(f"prompts[{i}] must be a str or a sequence of token ids, got {show(item)}")
    return items


def _with_params(encoded: list[Encoded], params: object) -> tuple[list[Encoded], list[SamplingParams]]:
    """Each prompt's SamplingParams (``_as_params_list``) and the prompts as the core will see them: ids cut to
    their params' truncate_prompt_tokens (``truncate_prompt``; the text stays as given). Where the offline API's
    prompt ids become final: ``generate``, ``chat`` and ``stream`` all pass here."""
    param_list = _as_params_list(params, len(encoded))
    pairs = zip(encoded, param_list, strict=True)
    kept = [(text, truncate_prompt(ids, p.truncate_prompt_tokens)) for (text, ids), p in pairs]
    return kept, param_list


def _as_params_list(params: object, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Sequence):
        raise RequestTypeError(f"sampling_params must be None, a SamplingParams or a list of them, got {show(params)}")
    param_list = list(params)
    for i, p in enumerate(param_list):
        if not isinstance(p, SamplingParams):
            raise RequestTypeError(f"sampling_params[{i}] must be a SamplingParams, got {show(p)}")
    if len(param_list) != n:
        raise InvalidRequestError(f"sampling_params has {len(param_list)} entries but there are {n} prompts")
    return param_list


def _as_conversations(messages: object) -> list[Conversation]:
    """One conversation (a list of message mappings) or several, as a list of conversations."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise RequestTypeError(
            f"messages must be a non-empty list of {{'role', 'content'}} messages, or a list of such lists, "
            f"got {show(messages)}"
        )
    return [messages] if isinstance(messages[0], Mapping) else list(messages)


def _check_conversation(conversation: object, name: str) -> None:
    """A conversation is a non-empty sequence of mappings with str "role" and "content"."""
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence) or not conversation:
        raise RequestTypeError(f"{name} must be a non-empty list of messages, got {show(conversation)}")
    for i, message in enumerate(conversation):
        ok = isinstance(message, Mapping) and all(isinstance(message.get(k), str) for k in ("role", "content"))
        if not ok:
            raise RequestTypeError(
                f"{name}[{i}] must be a {{'role': str, 'content': str}} mapping, got {show(message)}"
            )
