"""SamplingParams: per-request generation settings, frozen and validated at construction.

The pure core reads only the stop-related fields (``max_tokens``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``); the executor's sampler reads the rest; the LLM facade applies ``stop`` strings through its
detokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from fnvllm.state.checks import (
    REQUEST,
    check_bool,
    check_choice,
    check_int,
    check_optional_int,
    check_real,
    check_str,
    check_token_ids,
    fail,
)

MAX_LOGPROBS = 20
MAX_N = 128
"""The most completions one prompt may ask for: ``SamplingParams.n``, and the server's ``n`` and ``best_of``."""
# Counts, ids and seeds are bounded by 64-bit ranges (what the sampler's tensors hold), which also keeps every
# error message printable: Python refuses to print ints of more than 4300 digits.
MAX_INT64 = 2**63 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)
# Multiplying or dividing logits by a penalty outside this range overflows float32 or loses them entirely.
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
# Temperatures below this are treated as greedy: dividing logits by a smaller one overflows float32 (the sampler's
# dtype) or, below float32's range, divides by zero. vLLM uses the same threshold.
GREEDY_TEMPERATURE = 1e-5


def _strings(values: Any, name: str) -> tuple[str, ...]:
    """``values`` as a tuple: None, one str, or a list/tuple of non-empty strs (errors name ``name``)."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = (values,)
    if not isinstance(values, (list, tuple)):
        raise fail(REQUEST, name, "None, a str or a list of non-empty strs", values, wrong_type=True)
    for i, value in enumerate(values):
        check_str(value, f"{name}[{i}]", REQUEST)
    return tuple(values)


def _stop_strings(values: Any) -> tuple[str, ...]:
    """``stop`` as a tuple: None, one str, or a list/tuple of non-empty strs."""
    return _strings(values, "SamplingParams.stop")


def _bad_words(values: Any) -> tuple[str, ...]:
    """``bad_words`` as a tuple: None, one str, or a list/tuple of non-empty strs."""
    return _strings(values, "SamplingParams.bad_words")


def _bad_word_ids(values: Any) -> tuple[tuple[int, ...], ...]:
    """``bad_words_token_ids`` as a tuple of tuples: None, or a sequence of non-empty sequences of int ids >= 0
    (below the vocabulary size where the engine knows it: ``request.check_request``)."""
    name = "SamplingParams.bad_words_token_ids"
    if values is None:
        return ()
    if not isinstance(values, (list, tuple)):
        raise fail(REQUEST, name, "None or a sequence of token-id sequences", values, wrong_type=True)
    words = tuple(check_token_ids(word, f"{name}[{i}]", REQUEST, MAX_INT64) for i, word in enumerate(values))
    empty = [i for i, word in enumerate(words) if not word]
    if empty:
        raise fail(REQUEST, f"{name}[{empty[0]}]", "a non-empty sequence of token ids", values[empty[0]])
    return words


LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""OpenAI's range for a logit_bias value (-100 in effect bans a token, 100 all but forces it)."""


def _logit_bias(values: Any) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as sorted (token id, bias) pairs: None, a mapping id -> bias or a sequence of pairs; ids are
    ints >= 0 (below the vocabulary size where the engine knows it: ``request.check_request``), biases in
    [-100, 100]. An empty one is None."""
    name = "SamplingParams.logit_bias"
    if values is None:
        return None
    if isinstance(values, Mapping):
        values = tuple(values.items())
    if not isinstance(values, (list, tuple)):
        raise fail(
            REQUEST, name, "None, a dict token id -> bias or a sequence of (id, bias) pairs", values, wrong_type=True
        )
    pairs: dict[int, float] = {}
    for i, pair in enumerate(values):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise fail(REQUEST, f"{name}[{i}]", "a (token id, bias) pair", pair, wrong_type=True)
        token = check_int(pair[0], f"{name}[{i}] token id", REQUEST, 0, MAX_INT64)
        pairs[token] = check_real(pair[1], f"{name}[{token}]", REQUEST, *LOGIT_BIAS_RANGE)
    return tuple(sorted(pairs.items())) or None


def _allowed_ids(values: Any) -> tuple[int, ...] | None:
    """``allowed_token_ids`` as a tuple: None, or a non-empty sequence of int ids >= 0 (below the vocabulary size
    where the engine knows it: ``request.check_request``)."""
    name = "SamplingParams.allowed_token_ids"
    if values is None:
        return None
    ids = check_token_ids(values, name, REQUEST, MAX_INT64)
    if not ids:
        raise fail(REQUEST, name, "None or a non-empty sequence of token ids", values)
    return ids


TRUNCATE_PROMPT_TOKENS = "SamplingParams.truncate_prompt_tokens"


def truncate_prompt(ids: Sequence[int], keep: int | None) -> tuple[int, ...]:
    """The last ``keep`` of the prompt's ``ids`` (vLLM's ``truncate_prompt_tokens``); all of them when ``keep`` is
    None or the prompt is no longer. The one truncation rule of every front end (``LLM``, the server's
    handlers), applied where the prompt's ids are final, before the core sees them. ``keep``: None or an int >= 1
    (else InvalidRequestError naming truncate_prompt_tokens). Example: (5, 6, 7, 8), keep 2 -> (7, 8)."""
    keep = check_optional_int(keep, TRUNCATE_PROMPT_TOKENS, REQUEST, 1, MAX_INT64)
    ids = tuple(ids)
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def _stop_ids(values: Any) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple: None or a sequence of int ids >= 0."""
    return () if values is None else check_token_ids(values, "SamplingParams.stop_token_ids", REQUEST, MAX_INT64)


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


def _json_text(text: str, name: str) -> Any:
    """``text`` parsed as JSON, or InvalidRequestError naming ``name``."""
    try:
        return json.loads(text)
    except ValueError as error:
        raise fail(REQUEST, name, "valid JSON text", text) from error


@attrs.frozen
class StructuredOutput:
    """A constraint on a request's output, enforced by a grammar mask at every sampled token.

    kind: one of STRUCTURED_KINDS. text: what the kind needs:
        "json_object": "" (any JSON object);
        "json_schema": a JSON schema as JSON text (an object or a bool);
        "regex": a regular expression the whole output must match;
        "choice": a JSON array of non-empty strs, the output is exactly one of them;
        "grammar": an EBNF (GBNF) grammar, its root rule named ``root``.
    The grammar itself (regex and EBNF syntax) is checked by the engine when the request is added, since that
    needs the grammar library (``fnvllm.executor.structured.check_structured``).
    """

    kind: str
    text: str = ""

    def __attrs_post_init__(self) -> None:
        """Check kind and the text's shape (JSON where the kind takes JSON)."""
        name = "SamplingParams.structured"
        check_choice(self.kind, name + ".kind", REQUEST, STRUCTURED_KINDS)
        check_str(self.text, name + ".text", REQUEST, non_empty=self.kind not in ("json_object",))
        if self.kind == "json_schema":
            schema = _json_text(self.text, name + ".text (a JSON schema)")
            if not isinstance(schema, (dict, bool)):
                raise fail(REQUEST, name + ".text", "a JSON schema (an object or a bool)", schema)
        elif self.kind == "choice":
            choices = _json_text(self.text, name + ".text (a JSON array of strs)")
            if not isinstance(choices, list) or not choices:
                raise fail(REQUEST, name + ".text", "a non-empty JSON array of strs", choices)
            for i, choice in enumerate(choices):
                check_str(choice, f"{name}.text[{i}]", REQUEST)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> StructuredOutput:
        """A JSON-schema constraint from a schema (a dict, a bool, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Output that fully matches ``pattern``."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutput:
        """Output that is exactly one of ``choices``."""
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        """Output of an EBNF grammar (root rule ``root``)."""
        return cls("grammar", ebnf)


def _structured(value: Any) -> StructuredOutput | None:
    """``structured``: None or a StructuredOutput."""
    if value is not None and not isinstance(value, StructuredOutput):
        raise fail(REQUEST, "SamplingParams.structured", "None or a StructuredOutput", value, wrong_type=True)
    return value


@attrs.frozen
class SamplingParams:
    """How to sample one request's tokens.

    Every field is checked strictly when constructed: a bool is not an int, a str is not a number, NaN and
    infinities are out of range; errors (InvalidRequestError, RequestTypeError for a wrong type) name the field,
    the allowed range and the value. Numbers are stored as plain ints and floats (numpy scalars are accepted).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it. Range [0, 100]; below 1e-5
        (GREEDY_TEMPERATURE) it is treated as greedy, since smaller divisors overflow float32 logits.
    top_p: nucleus mass kept, (0, 1]. 1 disables.
    top_k: keep the k most likely tokens; None disables. >= 1.
    min_p: drop tokens whose probability is below min_p * max probability, [0, 1]. 0 disables.
    max_tokens: most tokens to generate, >= 1.
    ignore_eos: keep generating past the model's EOS ids (benchmarks).
    stop: strings that end generation (one str or a list of non-empty strs); not included in the text unless
        include_stop_str_in_output (which also keeps the text of a stop token id, below).
    stop_token_ids: token ids (>= 0; below the vocabulary size when the engine knows it) that end generation,
        in addition to EOS. The id that ends it stays in the output's token ids; its text is not in the output's
        text unless include_stop_str_in_output (as vLLM does).
    seed: per-request seed, an int in [-2**63, 2**64); a seeded request's draws do not depend on its batch mates
        (its random numbers are its own), so its tokens do not either where its logits do not: exactly so in
        float32; in bf16, batching can move a logit by a rounding step and so change a close draw.
    logprobs: return the top-n log-probabilities of each sampled position (and the sampled token's), n in
        [0, 20] (and at most the vocabulary size).
    repetition_penalty: HF-style multiplicative penalty on tokens seen in prompt or output, in [0.001, 1000];
        1 disables.
    presence_penalty / frequency_penalty: OpenAI-style additive penalties on output tokens, [-2, 2].
    structured: a StructuredOutput the output must follow (JSON schema, regex, choice, grammar), or None. The
        request ends with EOS once the grammar is complete (so ignore_eos must stay False).
    prompt_logprobs: None (off), or k in [0, 20]: return the log-probability of every prompt token given its
        prefix and the top-k at each position (vLLM's meaning; the first prompt token has none). Such a request
        is admitted without prefix-cache hits (every prompt position is computed).
    logit_bias: None, or (token id, bias) pairs (a dict id -> bias is accepted), bias in [-100, 100], added to the
        row's logits before the grammar mask, penalties, temperature and filters (logprobs stay raw). Stored
        sorted by id, one pair per id.
    min_tokens: fewest tokens to generate before EOS or a stop token id may end the request, in [0, max_tokens]
        (vLLM's meaning). Until then the sampler never draws those ids (the model's EOS ids and
        ``stop_token_ids``), the core does not stop on them, and ``stop`` strings are not looked for. 0 with
        ``structured`` (the grammar decides where the output ends).
    n: how many completions to sample for the prompt, in [1, 128] (MAX_N), returned together as one
        RequestOutput's ``outputs`` (index 0 .. n-1); with a seed, completion j draws from seed + j. LLM.generate,
        LLM.chat and LLM.stream run them as n requests sharing the prompt's cached KV (``copies``); the pure core
        itself takes only n = 1 (one sequence per request).
    skip_special_tokens: leave the tokenizer's special tokens (EOS, chat markers ...) out of the output's text
        (True, the default) or keep their text (False), as vLLM does; token ids are unaffected.
    truncate_prompt_tokens: None, or k >= 1: keep only the prompt's last k tokens (vLLM's meaning). The front
        ends (``LLM.generate`` / ``stream`` / ``chat``, the server) truncate before the core sees the prompt
        (``truncate_prompt``), so the output's prompt_token_ids are the kept ones; a shorter prompt is unchanged.
    allowed_token_ids: None, or a non-empty sequence of token ids (>= 0; below the vocabulary size when the engine
        knows it): the row samples only among them (every other id is masked after logit_bias and before the
        grammar mask, penalties, temperature and filters; logprobs stay raw).
    bad_words: words the output must not contain (one str or a list of non-empty strs; vLLM's meaning). Text needs
        a tokenizer: the front ends (``LLM``, the server) turn each word into ``bad_words_token_ids``
        (``fnvllm.engine.text.resolve_bad_words``: the word's ids, and those of the word after a space when that
        is a different first token of as many ids) and clear this field; the engine loop refuses it unresolved.
    bad_words_token_ids: token-id sequences the output must not contain (each non-empty; ids >= 0 and below the
        vocabulary size when the engine knows it). A one-id sequence bans that id at every step; a longer one bans
        its last id whenever the output ends with the rest (only generated tokens count, as in vLLM). Applied with
        the logit bias (MASKED_LOGIT at each banned id), so logprobs stay raw.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_ids)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured: StructuredOutput | None = attrs.field(default=None, converter=_structured)
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = attrs.field(default=None, converter=_logit_bias)
    min_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_allowed_ids)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_bad_words)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_bad_word_ids)
    # needs_history (derived): the sampler needs the request's prompt and output tokens (penalties, and bad words
    # of more than one token, which look at the output's last tokens).
    # Derived once here, read per row per step by the scheduler (a property would cost a call each time).
    needs_history: bool = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        """Check every field strictly (see checks.py) and store numbers as plain ints and floats."""
        name = "SamplingParams."
        checked = {
            "temperature": check_real(self.temperature, name + "temperature", REQUEST, 0, 100),
            "top_p": check_real(self.top_p, name + "top_p", REQUEST, 0, 1, low_open=True),
            "top_k": check_optional_int(self.top_k, name + "top_k", REQUEST, 1, MAX_INT64),
            "min_p": check_real(self.min_p, name + "min_p", REQUEST, 0, 1),
            "max_tokens": check_int(self.max_tokens, name + "max_tokens", REQUEST, 1, MAX_INT64),
            "ignore_eos": check_bool(self.ignore_eos, name + "ignore_eos", REQUEST),
            "include_stop_str_in_output": check_bool(
                self.include_stop_str_in_output, name + "include_stop_str_in_output", REQUEST
            ),
            "seed": check_optional_int(self.seed, name + "seed", REQUEST, *SEED_RANGE),
            "logprobs": check_optional_int(self.logprobs, name + "logprobs", REQUEST, 0, MAX_LOGPROBS),
            "repetition_penalty": check_real(
                self.repetition_penalty, name + "repetition_penalty", REQUEST, *REPETITION_PENALTY_RANGE
            ),
            "presence_penalty": check_real(self.presence_penalty, name + "presence_penalty", REQUEST, -2, 2),
            "frequency_penalty": check_real(self.frequency_penalty, name + "frequency_penalty", REQUEST, -2, 2),
            "prompt_logprobs": check_optional_int(
                self.prompt_logprobs, name + "prompt_logprobs", REQUEST, 0, MAX_LOGPROBS
            ),
            "min_tokens": check_int(self.min_tokens, name + "min_tokens", REQUEST, 0, MAX_INT64),
            "n": check_int(self.n, name + "n", REQUEST, 1, MAX_N),
            "skip_special_tokens": check_bool(self.skip_special_tokens, name + "skip_special_tokens", REQUEST),
            "truncate_prompt_tokens": check_optional_int(
                self.truncate_prompt_tokens, TRUNCATE_PROMPT_TOKENS, REQUEST, 1, MAX_INT64
            ),
        }
        for field, value in checked.items():
            object.__setattr__(self, field, value)
        if self.structured is not None and self.ignore_eos:
            raise fail(REQUEST, name + "ignore_eos", "False when structured is set (EOS ends a complete grammar)", True)
        if self.min_tokens > self.max_tokens:
            raise fail(REQUEST, name + "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if self.structured is not None and self.min_tokens:
            allowed = "0 when structured is set (the grammar decides where the output ends)"
            raise fail(REQUEST, name + "min_tokens", allowed, self.min_tokens)
        uses_history = (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(len(word) > 1 for word in self.bad_words_token_ids)
        )
        object.__setattr__(self, "needs_history", uses_history)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below GREEDY_TEMPERATURE, or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def copies(params: SamplingParams, num: int) -> list[SamplingParams]:
    """``num`` single-sequence copies of ``params`` (each with n=1): the requests that sample ``num`` completions
    of one prompt. The one fan-out rule of the offline API (``LLM``, for ``params.n``) and the server (for a body's
    ``n`` / ``best_of``).

    With a seed, copy j draws from seed + j, so the copies differ (copy 0 keeps the seed): seed 7, num 3 -> seeds
    7, 8, 9. Where seed + num - 1 would pass the top of SEED_RANGE they step down instead: seed 2**64 - 2, num 3 ->
    2**64 - 2, 2**64 - 3, 2**64 - 4. Without a seed every copy is the same object and draws from the engine's
    shared generator. ``num``: an int in [1, MAX_N]. Returns a new list; ``params`` is unchanged.
    """
    num = check_int(num, "copies num", REQUEST, 1, MAX_N)
    single = params if params.n == 1 else attrs.evolve(params, n=1)
    if single.seed is None or num == 1:
        return [single] * num
    step = 1 if single.seed + num - 1 <= SEED_RANGE[1] else -1
    return [attrs.evolve(single, seed=single.seed + step * j) for j in range(num)]
