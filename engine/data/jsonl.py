"""JSONL datasets: local files read line by line into tokenised samples, with per-line error reporting.

`data.path` is one `.jsonl` file or a folder whose `*.jsonl` files are read in name order.

`format=text`: each line is `{"text": str}`; every token is a target, and eos is appended when the tokenizer
has one (so the model learns where a document ends). `format=chat`: each line is
`{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`; only assistant turns are
targets (chat.py). Other keys on a line are ignored.

The whole file is tokenised eagerly at build time: simple and fine for files up to a few hundred MB; larger
corpora want a pre-tokenised cache, which is not built yet.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError

from .batch import IGNORE_INDEX
from .chat import BUILTIN_CHAT_TEMPLATE, ROLES, tokenize_chat
from .errors import DataError
from .stats import DataStats

logger = logging.getLogger(__name__)

_MAX_LOGGED_BAD_LINES = 20  # beyond this the count in DataStats.summary() says it; the log stays readable


class _BadLine(Exception):
    """A malformed line; the message is the reason, without file or line number."""


def load_jsonl(
    path: str | Path,
    tokenizer,
    *,
    fmt: str,
    seq_len: int,
    vocab_size: int,
    overlong: str,
    on_bad_line: str,
    source: str = "jsonl",
) -> tuple[list[dict], DataStats]:
    files = _jsonl_files(Path(path))
    chat_template = None
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        chat_template = BUILTIN_CHAT_TEMPLATE
        logger.warning(
            "the tokenizer %r has no chat_template; rendering chats with the built-in template "
            "'<|role|>\\ncontent<eos>' per message",
            getattr(tokenizer, "name_or_path", "?"),
        )
    reader = _Reader(tokenizer, chat_template, fmt, seq_len, vocab_size, overlong, on_bad_line, source)
    for file in files:
        reader.read(file)
    reader.stats.num_samples = len(reader.samples)
    return reader.samples, reader.stats


def _jsonl_files(path: Path) -> list[Path]:
    """A file, or a folder's `*.jsonl` files (not recursive) in name order, so the sample order is fixed."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise DataError(f"data.path={str(path)!r} is a folder without *.jsonl files; point it at your data")
        return files
    raise DataError(
        f"data.path={str(path)!r} does not exist (relative paths are taken from the working directory "
        f"{Path.cwd()}); give a local JSONL file or a folder of them"
    )


class _Reader:
    """Accumulates samples and stats over the files of one dataset."""

    def __init__(self, tokenizer, chat_template, fmt, seq_len, vocab_size, overlong, on_bad_line, source):
        self.tokenizer, self.chat_template, self.fmt = tokenizer, chat_template, fmt
        self.seq_len, self.vocab_size, self.overlong, self.on_bad_line = seq_len, vocab_size, overlong, on_bad_line
        self.stats = DataStats(source=source, num_target_tokens=0)
        self.samples: list[dict] = []

    def read(self, path: Path) -> None:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                self.stats.num_lines += 1
                try:
                    ids, labels = self._tokenize(raw)
                except _BadLine as e:
                    self.stats.num_bad_lines += 1
                    _report_bad_line(path, lineno, str(e), self.on_bad_line, self.stats.num_bad_lines)
                    continue
                if max(ids) >= self.vocab_size:
                    raise DataError(
                        f"{path}:{lineno}: token id {max(ids)} does not fit model.arch.vocab_size={self.vocab_size}; "
                        "use the tokenizer the model was trained with (data.tokenizer_path) or a larger "
                        "model.arch.vocab_size"
                    )
                self._keep(ids, labels)

    def _tokenize(self, raw: bytes) -> tuple[list[int], list[int]]:
        record = _parse_line(raw, self.fmt)
        if self.fmt == "text":
            ids = _tokenize_text(self.tokenizer, record)
            labels = list(ids)
        else:
            ids, labels, stable = _tokenize_chat(self.tokenizer, record, self.chat_template)
            self.stats.num_chat_boundary_mismatches += not stable
        if not ids:
            raise _BadLine("it tokenises to zero tokens")
        return ids, labels

    def _keep(self, ids: list[int], labels: list[int]) -> None:
        if len(ids) > self.seq_len:
            if self.overlong == "drop":
                self.stats.num_dropped += 1
                return
            ids, labels = ids[: self.seq_len], labels[: self.seq_len]
            self.stats.num_truncated += 1
        targets = sum(1 for t in labels[1:] if t != IGNORE_INDEX)  # after the causal shift, as in batch.py
        self.stats.num_all_masked += targets == 0
        self.stats.num_tokens += len(ids)
        self.stats.num_target_tokens += targets
        self.samples.append(
            {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}
        )


def _parse_line(raw: bytes, fmt: str):
    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise _BadLine(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not line:
        raise _BadLine("empty line")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object, got {type(obj).__name__}")
    key = "text" if fmt == "text" else "messages"
    if key not in obj:
        other_key, other_fmt = ("messages", "chat") if fmt == "text" else ("text", "text")
        hint = f"; it has {other_key!r}, so set data.format={other_fmt}" if other_key in obj else ""
        raise _BadLine(f"missing key {key!r} (data.format={fmt}){hint}")
    value = obj[key]
    if fmt == "text":
        if not isinstance(value, str):
            raise _BadLine(f"'text' must be a string, got {type(value).__name__}")
        if not value:
            raise _BadLine("'text' is empty")
        return value
    if not isinstance(value, list):
        raise _BadLine(f"'messages' must be a list, got {type(value).__name__}")
    if not value:
        raise _BadLine("'messages' is empty")
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise _BadLine(f"messages[{j}] must be an object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise _BadLine(f"messages[{j}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise _BadLine(f"messages[{j}].content must be a string, got {type(m.get('content')).__name__}")
    return value


def _tokenize_text(tokenizer, text: str) -> list[int]:
    ids = [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):  # some tokenizers already append eos themselves
        ids.append(int(eos))
    return ids


def _tokenize_chat(tokenizer, messages: list[dict], chat_template: str | None):
    try:
        return tokenize_chat(tokenizer, messages, chat_template)
    except (TemplateError, ValueError) as e:
        # Templates refuse some conversations themselves (e.g. roles that do not alternate).
        raise _BadLine(f"the chat template refused it: {e}") from None


def _report_bad_line(path: Path, lineno: int, reason: str, on_bad_line: str, count: int) -> None:
    if on_bad_line == "fail":
        raise DataError(
            f"{path}:{lineno}: malformed line: {reason}. Fix the line, or set data.on_bad_line=skip to skip "
            "malformed lines"
        )
    if count <= _MAX_LOGGED_BAD_LINES:
        logger.warning("%s:%d: skipping malformed line: %s", path, lineno, reason)
    if count == _MAX_LOGGED_BAD_LINES:
        logger.warning("%s: further malformed lines are skipped and counted, but not logged", path)
