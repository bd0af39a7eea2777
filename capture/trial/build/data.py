"""The data of the user's run: where it comes from, how it is tokenized (text or chat), how it
becomes batches (packed or padded), and the loader that resumes exactly where it stopped.

Every batch is a :class:`Batch`: ``input_ids``, ``labels`` (``-100`` where no loss is taken: pad
tokens, and with ``assistant_only_loss`` every token outside an assistant turn) and, when padded,
an ``attention_mask``; its real and pad token counts are known on the host, so throughput counts
real tokens without waiting for the device.

- ``packing = true``: documents (or rendered conversations) joined and cut into sequences of
  exactly ``max_seq_len`` tokens: every batch is as long as the run allows.
- ``packing = false``: one document a sequence (cut at ``max_seq_len``), each batch padded to its
  longest sequence. The first epoch takes the longest sequences first, so the warm-up and
  measured steps run on the longest batches of the user's data (the guide: "on your longest
  actual batches"); the manifest says which lengths were measured.
"""

from __future__ import annotations

import hashlib
import math
import re
from array import array
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

from capture import _json
from capture.errors import ConfigError
from capture.trial.config import TrialConfig

BYTE_EOT = 256  # end-of-text id for the byte-level tokenizer (ids 0-255 are the bytes)
IGNORE = -100
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One micro-batch. ``tokens`` and ``pad_tokens`` are host-side counts (no device sync)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    tokens: int = 0
    pad_tokens: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape

    def numel(self) -> int:
        """Real tokens (pad tokens excluded), the count throughput is measured in."""
        return self.tokens

    def _map(self, fn: Any) -> "Batch":
        return Batch(fn(self.input_ids), fn(self.labels), None if self.attention_mask is None else fn(self.attention_mask),
                     self.tokens, self.pad_tokens)

    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())

    def __getitem__(self, rows: Any) -> "Batch":
        """Rows of the batch (``batch[rank::world]``), counts recomputed."""
        mask = None if self.attention_mask is None else self.attention_mask[rows]
        ids = self.input_ids[rows]
        real = int(mask.sum()) if mask is not None else ids.numel()
        return Batch(ids, self.labels[rows], mask, real, ids.numel() - real)

    def repeat(self, n: int) -> "Batch":
        """``n`` copies of the first row (the memory a step needs does not depend on the content)."""
        return Batch(self.input_ids[:1].repeat(n, 1), self.labels[:1].repeat(n, 1),
                     None if self.attention_mask is None else self.attention_mask[:1].repeat(n, 1),
                     self.tokens // max(1, self.input_ids.shape[0]) * n,
                     self.pad_tokens // max(1, self.input_ids.shape[0]) * n)

    def token_hash(self) -> str:
        """sha256 of the input ids (dtype, shape, bytes): what a step trained on."""
        t = self.input_ids.detach().to("cpu").contiguous()
        return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()).hexdigest()


def full_batch(ids: torch.Tensor) -> Batch:
    """A batch without padding whose labels are its inputs (causal LM: the model shifts them)."""
    return Batch(ids, ids, None, ids.numel(), 0)


# --------------------------------------------------------------------------- sources


class SequenceSource:
    """Sequences addressed by index; ``rows`` makes a :class:`Batch` of them."""

    def __len__(self) -> int:
        raise NotImplementedError

    def rows(self, idx: list[int]) -> Batch:
        raise NotImplementedError

    def length(self, i: int) -> int:
        raise NotImplementedError


class PackedTokens(SequenceSource):
    """Blocks of exactly ``seq_len`` tokens; ``labels`` (same shape) when some tokens carry no loss."""

    def __init__(self, blocks: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        self.blocks, self.labels = blocks, labels

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def length(self, i: int) -> int:
        return self.blocks.shape[1]

    def rows(self, idx: list[int]) -> Batch:
        ids = self.blocks[idx]
        labels = self.labels[idx] if self.labels is not None else ids
        return Batch(ids, labels, None, ids.numel(), 0)


class SyntheticTokens(SequenceSource):
    """Seeded random tokens; sequence ``i`` is the same whenever and wherever it is drawn."""

    def __init__(self, count: int, offset: int, seq_len: int, vocab: int, seed: int) -> None:
        self.count, self.offset, self.seq_len, self.vocab, self.seed = count, offset, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.count

    def length(self, i: int) -> int:
        return self.seq_len

    def rows(self, idx: list[int]) -> Batch:
        out = torch.empty((len(idx), self.seq_len), dtype=torch.long)
        for row, i in enumerate(idx):
            g = torch.Generator().manual_seed(self.seed * 7_919 + self.offset + i)
            out[row] = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return full_batch(out)


class PaddedSequences(SequenceSource):
    """One sequence per document, each batch right-padded to its longest sequence."""

    def __init__(self, ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int) -> None:
        self.ids, self.labels, self.pad_id = ids, labels, pad_id

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, i: int) -> int:
        return len(self.ids[i])

    def rows(self, idx: list[int]) -> Batch:
        width = max(len(self.ids[i]) for i in idx)
        ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(idx), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        real = 0
        for row, i in enumerate(idx):
            n = len(self.ids[i])
            ids[row, :n] = torch.tensor(self.ids[i], dtype=torch.long)
            labels[row, :n] = torch.tensor(self.labels[i], dtype=torch.long)
            mask[row, :n] = 1
            real += n
        return Batch(ids, labels, mask, real, ids.numel() - real)


# --------------------------------------------------------------------------- loader


class PackedLoader:
    """An endless, resumable stream of micro-batches.

    The order is a fresh permutation of the sequences every epoch, drawn from a generator seeded
    by ``(seed, epoch)``; with ``longest_first`` the first epoch takes the sequences longest first
    (ties in the seeded order). The position is ``(epoch, index)``, so restoring a
    ``state_dict()`` in a new process continues with exactly the same batches.
    """

    def __init__(self, source: SequenceSource, micro_batch: int, seed: int, device: torch.device,
                 longest_first: bool = False) -> None:
        self.source, self.micro_batch, self.seed, self.device = source, micro_batch, seed, device
        self.longest_first = longest_first
        self.epoch, self.index = 0, 0
        self._perm: list[int] | None = None
        self._pin = device.type == "cuda"

    def _order(self) -> list[int]:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            perm = torch.randperm(len(self.source), generator=g).tolist()
            if self.longest_first and self.epoch == 0:
                rank = {i: r for r, i in enumerate(perm)}
                perm = sorted(perm, key=lambda i: (-self.source.length(i), rank[i]))
            self._perm = perm
        return self._perm

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> Batch:
        picks: list[int] = []
        while len(picks) < self.micro_batch:
            order = self._order()
            take = min(self.micro_batch - len(picks), len(order) - self.index)
            picks.extend(order[self.index:self.index + take])
            self.index += take
            if self.index >= len(order):
                self.epoch, self.index, self._perm = self.epoch + 1, 0, None
        batch = self.source.rows(picks)
        if self._pin:
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "micro_batch": self.micro_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self._perm = int(state["epoch"]), int(state["index"]), None
        self.seed = int(state.get("seed", self.seed))


# --------------------------------------------------------------------------- reading


def corpus_text() -> str:
    """The shipped text corpus (project-own prose, Apache-2.0), used by the tiny example."""
    return (resources.files("capture.trial") / "data" / "corpus.txt").read_text(encoding="utf-8")


def _record(f: Path, text: str, at: int) -> Any:
    """``text``, starting at line ``at`` of ``f``, as JSON; an error names the file's line."""
    try:
        return _json.loads(text)
    except _json.JsonError as exc:  # bad syntax, an integer over 4,300 digits, nesting too deep
        where = at + exc.lineno - 1 if exc.lineno else at
        raise ConfigError(f"trial.data: {f.name} is not valid JSON (line {where}: {exc.reason})",
                          "fix or remove the file") from None


def _rows(f: Path, text: str, suffix: str) -> list[Any]:
    """The records of one .jsonl (a line each) or .json (one array) file."""
    rows = ([_record(f, line, at) for at, line in enumerate(text.splitlines(), 1) if line.strip()]
            if suffix == ".jsonl" else _record(f, text, 1))
    if not isinstance(rows, list):
        raise ConfigError(f"trial.data: {f.name} must hold a JSON array of objects", "or use .jsonl, one object a line")
    return rows


def read_records(root: Path, config: TrialConfig, key: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """Documents (strings) or conversations (lists of messages) from a file or a folder's files."""
    d = config.data
    files = [root] if root.is_file() else sorted({p for pat in d.files for p in root.glob(pat) if p.is_file()})
    if not files:
        raise ConfigError(f"{key}: no files matching {', '.join(d.files)} in {root}",
                          "point it at .txt, .jsonl or .json files, or set trial.data.files")
    records: list[Any] = []
    listing: list[dict[str, Any]] = []
    for f in files:
        raw = f.read_bytes()
        listing.append({"path": str(f.relative_to(root)) if f != root else f.name, "size_bytes": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest()})
        text = raw.decode("utf-8", errors="replace")
        suffix = f.suffix.lower()
        if suffix in (".txt", ".md"):
            if d.format == "chat":
                raise ConfigError(f"trial.data.format: {f.name}: chat data is rows of messages (.jsonl/.json)",
                                  'convert it, or use format = "text"')
            records.extend(doc for doc in text.split("\n\n") if doc.strip())
        elif suffix in (".jsonl", ".json"):
            field_name = d.messages_field if d.format == "chat" else d.text_field
            for row in _rows(f, text, suffix):
                value = row.get(field_name) if isinstance(row, dict) else None
                if d.format == "chat":
                    if not (isinstance(value, list) and value and all(
                            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                            for m in value)):
                        raise ConfigError(f"trial.data.messages_field: {f.name} has a row without a list of "
                                          f"{{role, content}} messages in {field_name!r}", "name the field that holds them")
                elif not isinstance(value, str):
                    raise ConfigError(f"trial.data.text_field: {f.name} has a row without a string field {field_name!r}",
                                      "name the field that holds the text")
                records.append(value)
        else:
            raise ConfigError(f"trial.data.files: {f.name}: only .txt, .md, .jsonl and .json can be read",
                              "convert the data to .jsonl (one {\"text\": ...} object a line)")
    return records, listing


def resolve_snapshot(repo_id: str, revision: str | None, repo_type: str, key: str) -> Path:
    """A repo revision's snapshot folder in the local hub cache; the trial never downloads.

    Resolved like the fingerprint resolves it (capture.probes.artifacts), so the commit in
    ``[trial.run]`` is the one in ``[[models]]``/``[[datasets]]``.
    """
    rev = revision or "main"
    cmd = f"hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''} --revision {rev}"
    from capture.errors import UsageError
    from capture.probes import ProbeOptions
    from capture.probes.artifacts import hub_cache_dir, resolve_commit

    cache = hub_cache_dir(ProbeOptions())
    try:
        folder, commit = resolve_commit(cache, repo_type, repo_id, rev, f"{repo_id}@{rev}")
    except UsageError as exc:
        raise ConfigError(f"{key}: {exc.message}", f"download it first (`{cmd}`), or set --hf-cache; "
                                                   "the trial itself runs offline") from None
    return folder / "snapshots" / commit


# --------------------------------------------------------------------------- tokenizing


class _Tokens:
    """ids and labels of every record, each an int64 ``array`` (8 bytes a token). Where a record's
    labels are its ids, ``labels[i] is ids[i]`` (one array, never mutated): a large data set is
    held once, not twice."""

    def __init__(self) -> None:
        self.ids: list[array[int]] = []
        self.labels: list[array[int]] = []


TEXT_BATCH = 1000  # text records a tokenizer call


def _load_tokenizer(tokenizer_dir: Path | None) -> Any:
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        raise ConfigError('trial.data.tokenizer: "model", but the model has no tokenizer files',
                          "put tokenizer.json / tokenizer_config.json beside the model's config.json")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"trial.data.tokenizer: cannot load the tokenizer in {tokenizer_dir} ({str(exc).splitlines()[0][:200]})",
                          "the folder needs the tokenizer files of the model") from None


def _input_ids(value: Any) -> Any:
    """The ids of a tokenizer's (or apply_chat_template's) output: a dict of outputs or the ids themselves."""
    return value["input_ids"] if isinstance(value, dict) or hasattr(value, "keys") else value


def _ids(value: Any) -> list[int]:
    return [int(x) for x in _input_ids(value)]


def _has_template(tok: Any) -> None:
    if not getattr(tok, "chat_template", None):
        raise ConfigError('trial.data.format: "chat", but the tokenizer has no chat template',
                          "use the model's tokenizer with its chat_template, or format = \"text\"")


def _chat(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """A conversation rendered with the chat template; labels -100 outside its assistant turns."""
    ids = _ids(tok.apply_chat_template(messages, tokenize=True))
    if _GENERATION_TAG.search(tok.chat_template or ""):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        mask = list(out["assistant_masks"])
        return ids, [t if m else IGNORE for t, m in zip(ids, mask)]
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _ids(tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)) if i else []
        upto = _ids(tok.apply_chat_template(messages[:i + 1], tokenize=True))
        if upto[:len(prefix)] != prefix or ids[:len(upto)] != upto:
            raise ConfigError("trial.data.assistant_only_loss: the chat template does not render conversations "
                              "prefix by prefix, so the assistant turns cannot be found",
                              "use a template with {% generation %} markers, or assistant_only_loss = false")
        labels[len(prefix):len(upto)] = ids[len(prefix):len(upto)]
    return ids, labels


def tokenize(config: TrialConfig, records: list[Any], vocab_size: int, tokenizer_dir: Path | None,
             info: dict[str, Any]) -> tuple[_Tokens, int, int | None]:
    """ids/labels per record, the pad id and the end-of-text id appended between packed documents."""
    d = config.data
    out = _Tokens()
    if d.tokenizer == "bytes":
        if vocab_size < BYTE_EOT + 1:
            raise ConfigError(f"trial.data.tokenizer: byte-level ids need a vocabulary of at least 257, the model has {vocab_size}",
                              'set vocab_size >= 257 in [trial.model.config] or use tokenizer = "model"')
        for doc in records:
            ids = array("q", array("B", doc.encode("utf-8")))
            out.ids.append(ids)
            out.labels.append(ids)  # the same array: labels equal to ids cost no memory twice (never mutated)
        info["tokenizer"] = "bytes (UTF-8 bytes 0-255, end-of-text 256)"
        return out, BYTE_EOT, BYTE_EOT
    tok = _load_tokenizer(tokenizer_dir)
    if d.format == "chat":
        _has_template(tok)
    if d.format == "chat" and d.assistant_only_loss:
        # Finding the assistant turns takes each conversation's own renderings: one at a time.
        for rec in records:
            chat_ids, chat_labels = _chat(tok, rec)
            out.ids.append(array("q", chat_ids))  # 8 bytes a token, not a Python int and its pointer
            out.labels.append(array("q", chat_labels))
    else:
        # A batch a call, which a fast tokenizer encodes on every core: the same ids as one call a
        # record (apply_chat_template renders each conversation, then encodes the batch). Text
        # 1.75x, chat 1.82x on 2 cores; 5.24x and 4.46x on an H100 host's 16 (benchmarks/
        # tokenize_speed.py, docs/measurements/h100-host-tokenize-speed.txt).
        for start in range(0, len(records), TEXT_BATCH):
            batch = records[start:start + TEXT_BATCH]
            encoded = (tok.apply_chat_template(batch, tokenize=True) if d.format == "chat"
                       else tok(batch, add_special_tokens=False))
            for row in _input_ids(encoded):
                packed = array("q", row)
                out.ids.append(packed)
                out.labels.append(packed)  # labels are the ids: the same array, held once
    top = max((max(ids) for ids in out.ids if ids), default=0)
    if top >= vocab_size:
        raise ConfigError(f"trial.data.tokenizer: the tokenizer yields id {top}, beyond the model's vocabulary ({vocab_size})",
                          "use the tokenizer that belongs to the model")
    info["tokenizer"] = f"model ({type(tok).__name__}, {tokenizer_dir.name if tokenizer_dir else ''})"
    eot = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eot if eot is not None else 0)
    return out, int(pad), (int(eot) if eot is not None and d.format == "text" else None)


# --------------------------------------------------------------------------- the data set


@dataclass
class DataSet:
    train: SequenceSource
    val: SequenceSource | None
    longest_first: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def _split(n: int, fraction: float, key: str) -> int:
    n_val = min(n - 1, math.ceil(n * fraction)) if fraction else 0
    if n - n_val < 1:
        raise ConfigError(f"{key}: leaves no training sequences", "lower trial.data.validation_fraction or give more data")
    return n_val


def _joined(seqs: Sequence[Sequence[int]], eot: int | None) -> torch.Tensor:
    """The sequences end to end (``eot`` after each) as one int64 tensor, built in a packed buffer
    (8 bytes a token) rather than a list of Python ints."""
    buf = array("q")
    for a in seqs:
        buf.extend(a)
        if eot is not None:
            buf.append(eot)
    return torch.frombuffer(buf, dtype=torch.int64).clone() if buf else torch.zeros(0, dtype=torch.long)


def _digest(seqs: Sequence[array[int]]) -> str:
    """sha256 of the int64 sequences end to end (the bytes of :func:`_joined` without ``eot``)."""
    h = hashlib.sha256()
    for a in seqs:
        h.update(a)  # an int64 array is its own bytes: no copy
    return h.hexdigest()


def _packed(tokens: _Tokens, eot: int | None, seq: int, fraction: float, info: dict[str, Any]) -> DataSet:
    flat = _joined(tokens.ids, eot)
    n_blocks = flat.numel() // seq
    if n_blocks < 2:
        raise ConfigError(f"trial.batch.max_seq_len: the data holds {flat.numel()} tokens, fewer than 2 sequences of {seq}",
                          "lower max_seq_len or give more data")
    blocks = flat[: n_blocks * seq].view(n_blocks, seq)
    same = all(b is a for a, b in zip(tokens.ids, tokens.labels))
    lab = blocks if same else _joined(tokens.labels, eot)[: n_blocks * seq].view(n_blocks, seq)
    has_labels = not torch.equal(lab, blocks)
    n_val = _split(n_blocks, fraction, "trial.data.validation_fraction")
    info.update(packing=f"packed into sequences of exactly {seq} tokens", tokens_total=int(flat.numel()),
                tokens_sha256=hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                train_sequences=n_blocks - n_val, val_sequences=n_val, train_tokens=(n_blocks - n_val) * seq,
                dropped_tail_tokens=int(flat.numel() - n_blocks * seq), longest_sequence=seq,
                measured_on=f"packed sequences, every one exactly {seq} tokens (max_seq_len): the longest the run allows")
    if has_labels:
        info["loss_tokens_share"] = float((lab != IGNORE).float().mean())
    train = PackedTokens(blocks[: n_blocks - n_val], lab[: n_blocks - n_val] if has_labels else None)
    val = PackedTokens(blocks[n_blocks - n_val:], lab[n_blocks - n_val:] if has_labels else None) if n_val else None
    return DataSet(train, val, False, info)


def _padded(tokens: _Tokens, pad: int, eot: int | None, config: TrialConfig, info: dict[str, Any]) -> DataSet:
    seq = config.batch.max_seq_len
    tail = array("q", [eot] if eot is not None else [])
    ids = [(a + tail)[:seq] for a in tokens.ids]
    labels = [ids[i] if b is a else (b + tail)[:seq] for i, (a, b) in enumerate(zip(tokens.ids, tokens.labels))]
    keep = [i for i, a in enumerate(ids) if len(a) >= 2]
    ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    if len(ids) < 2:
        raise ConfigError("trial.data: fewer than 2 documents of at least 2 tokens", "give more data")
    n_val = _split(len(ids), config.data.validation_fraction, "trial.data.validation_fraction")
    train_ids, val_ids = ids[: len(ids) - n_val], ids[len(ids) - n_val:]
    lengths = sorted((len(a) for a in train_ids), reverse=True)
    mb = config.batch.micro_batch_size
    measured = (config.warmup_steps + config.measured_steps) * mb * config.batch.grad_accum
    first = lengths[:measured]
    total = sum(len(a) for a in ids)
    info.update(packing=f"one document a sequence (cut at {seq} tokens), each batch padded to its longest sequence",
                pad_id=pad, tokens_total=total, tokens_sha256=_digest(ids),
                train_sequences=len(train_ids), val_sequences=n_val, train_tokens=sum(len(a) for a in train_ids),
                truncated_sequences=sum(1 for a in tokens.ids if len(a) + (eot is not None) > seq),
                longest_sequence=lengths[0], median_sequence=lengths[len(lengths) // 2],
                measured_on=(f"the longest sequences of the data first: the warm-up and measured steps take the "
                             f"{len(first)} longest ({first[0]} down to {first[-1]} tokens) of {len(lengths)}"))
    loss_tokens = sum(len(b) if b is a else sum(1 for t in b if t != IGNORE) for a, b in zip(ids, labels))
    info["loss_tokens_share"] = loss_tokens / max(1, total)
    train = PaddedSequences(train_ids, labels[: len(ids) - n_val], pad)
    val = PaddedSequences(val_ids, labels[len(ids) - n_val:], pad) if n_val else None
    return DataSet(train, val, True, info)


def build_data(config: TrialConfig, vocab_size: int, tokenizer_dir: Path | None) -> DataSet:
    d, seq = config.data, config.batch.max_seq_len
    info: dict[str, Any] = {"source": d.source, "format": d.format, "packing_enabled": d.packing}
    if d.source == "synthetic":
        n_val = math.ceil(d.synthetic_sequences * d.validation_fraction) if d.validation_fraction else 0
        n_train = d.synthetic_sequences - n_val
        if n_train < 1:
            raise ConfigError("trial.data.validation_fraction: leaves no training sequences", "lower it")
        info.update(tokenizer="none (uniform random ids)", vocab_size=vocab_size, train_sequences=n_train,
                    val_sequences=n_val, train_tokens=n_train * seq, longest_sequence=seq,
                    packing=f"synthetic sequences of exactly {seq} tokens",
                    measured_on=f"synthetic sequences, every one exactly {seq} tokens (max_seq_len)")
        train = SyntheticTokens(n_train, 0, seq, vocab_size, config.seed)
        val = SyntheticTokens(n_val, n_train, seq, vocab_size, config.seed) if n_val else None
        return DataSet(train, val, False, info)

    if d.source == "corpus":
        records: list[Any] = [p for p in corpus_text().split("\n\n") if p.strip()]
        info["name"] = "capture built-in corpus (project-own text)"
    else:
        if d.source == "local":
            root = config.resolve_path(d.path or "")
            if not root.exists():
                raise ConfigError(f"trial.data.path: {root} does not exist", "name a folder or file of .txt/.jsonl/.json")
            info["path"] = str(root)
            key = "trial.data.path"
        else:
            root = resolve_snapshot(d.repo_id or "", d.revision, "dataset", "trial.data.repo_id")
            info.update(repo_id=d.repo_id, revision=d.revision or "main", commit=root.name)
            key = "trial.data.repo_id"
        records, info["files"] = read_records(root, config, key)
    info["documents" if d.format == "text" else "conversations"] = len(records)
    if d.format == "chat":
        info["assistant_only_loss"] = d.assistant_only_loss
    tokens, pad, eot = tokenize(config, records, vocab_size, tokenizer_dir, info)
    if d.packing:
        return _packed(tokens, eot, seq, d.validation_fraction, info)
    return _padded(tokens, pad, eot, config, info)


def longest_batch_len(data: DataSet, micro_batch: int) -> int:
    """The padded length of the longest micro-batch the run takes (the estimate's sequence length)."""
    if isinstance(data.train, PaddedSequences):
        return max(data.train.length(i) for i in range(len(data.train)))
    return data.train.length(0)


def token_counts(rows: Sequence[Batch]) -> tuple[int, int]:
    return sum(b.tokens for b in rows), sum(b.pad_tokens for b in rows)
