"""The per-step timeline log (JSONL): what the GPU engine writes under ``FNVLLM_TIMELINE=path.jsonl`` and what
``fnvllm simulate --timeline`` writes with predicted times, so both can be calibrated from and compared.

First line (optional): ``{"model": {config.json fields}, "block_size": int, "device": str}``; the model fields
should include ``torch_dtype`` and ``max_position_embeddings`` (also read from the top level of the header as
``dtype`` / ``max_position_embeddings``; without them bf16 and 40960 are assumed). Then one object per step:
``{"step", "num_seqs", "num_tokens", "num_decode_seqs", "num_prefill_tokens", "context_tokens", "gpu_ms",
"cpu_ms", "gap_ms", "graph"}``; optionally ``attn_pairs`` and ``num_samples`` (exact when present, estimated
otherwise, see ``record_shape``), ``num_new_seqs`` (rows admitted or resumed in the step; estimated as the
non-decode rows when absent) and ``overlap`` (whether the loop overlapped the step; the header's ``overlap``
applies to records without one). ``context_tokens`` sums start position + fed tokens over the scheduled sequences.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from fnvllm.sim.checks import SimInputError, check_bool_field, check_count, check_mapping, check_real_in
from fnvllm.sim.cost import StepShape
from fnvllm.sim.model import ModelShape

REQUIRED = ("num_seqs", "num_tokens", "num_decode_seqs", "num_prefill_tokens", "context_tokens", "gpu_ms", "graph")


def read_timeline(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header (``{}`` if absent) and the step records of a timeline; ValueError naming a bad line."""
    header: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SimInputError(f"{path} line {number} is not JSON: {e}") from None
        if not isinstance(record, dict):
            raise SimInputError(f"{path} line {number} is not a JSON object")
        if "model" in record and not records:
            check_mapping(record["model"], f"{path} line {number} model")
            header = record
            continue
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise SimInputError(f"{path} line {number} lacks {missing}")
        try:
            _check_record(record)
        except SimInputError as e:
            raise type(e)(f"{path} line {number}: {e}") from None
        overlap = _header_overlap(header)
        if overlap is not None:
            record.setdefault("overlap", overlap)
        records.append(record)
    if not records:
        raise SimInputError(f"{path} holds no step records")
    return header, records


def _header_overlap(header: Mapping[str, Any]) -> bool | None:
    """The loop mode a header implies: its ``overlap``; else False for a CPU device (the engine overlaps steps
    only on CUDA); else unknown."""
    if isinstance(header.get("overlap"), bool):
        return bool(header["overlap"])
    return False if str(header.get("device", "")).lower().startswith("cpu") else None


_COUNTS = ("num_seqs", "num_tokens", "num_decode_seqs", "num_prefill_tokens", "context_tokens")
_OPTIONAL_COUNTS = ("step", "attn_pairs", "num_samples", "num_new_seqs")

_TIMES = ("gpu_ms", "cpu_ms", "gap_ms")


def _check_record(record: Mapping[str, Any]) -> None:
    """SimInputError naming the first field of a step record that is not a count, a time or a bool."""
    for key in _COUNTS:
        check_count(record[key], key, 0, 1 << 62)
    for key in _OPTIONAL_COUNTS:
        if record.get(key) is not None:
            check_count(record[key], key, 0, 1 << 62)
    for key in _TIMES:
        if key in record:
            check_real_in(record[key], key, 0.0, 1e9)
    check_bool_field(record["graph"], "graph")


def header_model(header: Mapping[str, Any], name: str = "logged") -> ModelShape:
    """The ModelShape a timeline header describes; ValueError when it has no model. A top-level ``dtype`` or
    ``max_position_embeddings`` fills in what the model dict lacks (``torch.bfloat16`` reads as bfloat16)."""
    if "model" not in header:
        raise ValueError("the timeline has no header line with the model")
    config = dict(header["model"])
    for key, top in (("torch_dtype", "dtype"), ("max_position_embeddings", "max_position_embeddings")):
        if config.get(key) is None and header.get(top) is not None:
            config[key] = header[top]
    if config.get("torch_dtype") is not None:
        config["torch_dtype"] = str(config["torch_dtype"]).removeprefix("torch.")
    return ModelShape.from_config(config, name=name)


def record_new_seqs(record: Mapping[str, Any]) -> int:
    """Rows new in the step (admitted or resumed): ``num_new_seqs`` when recorded (the simulator and the run
    recorder write it), else estimated as the rows that are not single-token decodes."""
    new = record.get("num_new_seqs")
    return int(new) if new is not None else int(record["num_seqs"]) - int(record["num_decode_seqs"])


def record_overlap(record: Mapping[str, Any]) -> bool | None:
    """Whether the loop overlapped this step (``overlap`` of the record, else of the header), None if unknown."""
    value = record.get("overlap")
    return None if value is None else bool(value)


def record_shape(record: Mapping[str, Any]) -> StepShape:
    """The StepShape of a timeline record. Without ``attn_pairs``, prefill rows are taken as chunks from position 0
    of equal length (decodes exact); without ``num_samples``, every sequence counts as sampled."""
    seqs, tokens, decodes = int(record["num_seqs"]), int(record["num_tokens"]), int(record["num_decode_seqs"])
    prefill, context = int(record["num_prefill_tokens"]), int(record["context_tokens"])
    pairs = record.get("attn_pairs")
    if pairs is None:
        prefill_seqs = max(seqs - decodes, 1)
        pairs = context if not prefill else (context - prefill) + prefill * (prefill / prefill_seqs + 1) / 2
    samples = int(record.get("num_samples", seqs))
    return StepShape(seqs, tokens, decodes, prefill, context, int(pairs), samples, bool(record["graph"]))


class TimelineWriter:
    """Writes a timeline: ``header(...)`` once, then ``step(index, shape, gpu_s, gap_s)`` per step."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def header(self, model: Mapping[str, Any], block_size: int, device: str, overlap: bool | None = None) -> None:
        """The first line: the model's config fields, the block size, the device name (and whether the loop
        overlapped its steps, when known)."""
        header: dict[str, Any] = {"model": dict(model), "block_size": block_size, "device": device}
        if overlap is not None:
            header["overlap"] = overlap
        self._write(header)

    def step(
        self,
        index: int,
        shape: StepShape,
        gpu_s: float,
        gap_s: float,
        cpu_s: float = 0.0,
        num_new_seqs: int = 0,
        plain: bool = False,
    ) -> None:
        """One step's record (times in milliseconds in the file); ``plain``: the step ran plainly in an overlapped
        loop (the first after an idle device: ``"overlap": false`` in its record)."""
        record = {"step": index, **shape.to_record(), "num_new_seqs": num_new_seqs}
        record.update(gpu_ms=gpu_s * 1e3, cpu_ms=cpu_s * 1e3, gap_ms=gap_s * 1e3)
        if plain:
            record["overlap"] = False
        self._write(record)

    def _write(self, record: Mapping[str, Any]) -> None:
        self.stream.write(json.dumps(record) + "\n")
