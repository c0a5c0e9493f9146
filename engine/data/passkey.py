"""The passkey (needle-in-a-haystack) task: a key hidden in filler text, asked for at the end.

    [filler ... needle ... filler ...] question answer
    needle:   " The pass key is #40817. Remember it. #40817 is the pass key."
    question: " What is the pass key? The pass key is #"     answer: "40817"

Only the answer's tokens carry labels (-100 elsewhere), so the loss and the retrieval score measure nothing but
retrieval. With distractors every needle is named (" The red pass key is ...") and the question asks for one
name, RULER's multi-key variant; with several needles the asked name has several keys, answered in order of
appearance ("40817, #55120"), RULER's multi-value variant. The key follows a "#" and is tokenised on its own,
without the space before it, so its ids are the same in the needle and the answer for any BPE tokenizer,
and the token before it marks where a key starts.

Every sample is a pure function of (seed, index) for training, or (seed, length, depth, j) for the held-out
grid (a separate stream, so grid samples are never training samples): never of the layout. The filler is the
shipped corpus's sentences drawn at random, or the classic repeated "The grass is green..." lines; each
needle sits at the sentence boundary nearest its depth (0 = before the first filler token, 1 = after the
last), so it lands within half a sentence of the depth asked for. A sample is exactly its length: the last
filler sentence is cut to fit. Pieces are tokenised separately and concatenated (the same ids in training,
evaluation and generation, whatever a tokenizer would merge across a piece boundary).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .batch import IGNORE_INDEX
from .errors import DataError

REPEAT_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                 "There and back again.")
NAMES = ("red", "blue", "green", "amber", "violet", "silver", "golden", "white", "black", "orange", "purple",
         "grey")


@dataclass
class PasskeySample:
    input_ids: list[int]
    labels: list[int]          # unshifted: the answer's ids at its positions, -100 elsewhere
    keys: list[str]            # the asked keys, in order of appearance
    needle_starts: list[int]   # token offset of every needle (asked and distractor), in the sample
    depths: list[float]        # the depth each asked needle was placed for
    filler_len: int            # filler tokens (the haystack), needles excluded
    answer_start: int          # first answer token

    def as_item(self) -> dict:
        return {"input_ids": torch.tensor(self.input_ids, dtype=torch.long),
                "labels": torch.tensor(self.labels, dtype=torch.long)}


def _seed_of(*parts) -> int:
    # a hash, not arithmetic on the seed: neighbouring seeds or indices must not give shifted copies
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class PasskeyTask:
    """Builds samples of the task from a tokenizer and `data.passkey` (configs/data.py PasskeyConfig)."""

    def __init__(self, pcfg: Any, tokenizer, corpus_path=None):
        self.cfg = pcfg
        self.tok = tokenizer
        texts = REPEAT_FILLER if pcfg.filler == "repeat" else _corpus_sentences(corpus_path)
        self.sentences = [self._ids(t) for t in texts]
        self.sentences = [s for s in self.sentences if s]
        if not self.sentences:
            raise DataError("the passkey filler has no sentences; check data.passkey.filler and the corpus")

    def _ids(self, text: str, space: bool = True) -> list[int]:
        return [int(t) for t in self.tok(" " * space + text, add_special_tokens=False)["input_ids"]]

    def make(self, rng: random.Random, length: int, depth: Optional[float] = None) -> PasskeySample:
        """One sample of exactly `length` tokens; the first asked needle at `depth` (else drawn uniformly)."""
        c = self.cfg
        names = rng.sample(NAMES, c.num_distractors + 1) if c.num_distractors else [""]
        asked = names[0]
        keys = _distinct_keys(rng, c.key, c.key_length, c.num_needles + c.num_distractors)
        needles = [(asked, k, True) for k in keys[:c.num_needles]]
        needles += [(n, k, False) for n, k in zip(names[1:], keys[c.num_needles:])]
        depths = [rng.uniform(c.depth_min, c.depth_max) for _ in needles]
        if depth is not None:
            depths[0] = depth
        label = f"{asked} " if asked else ""
        plural = c.num_needles > 1
        question = self._ids(f"What {'are' if plural else 'is'} the {label}pass key{'s' if plural else ''}? "
                             f"The {label}pass key{'s are' if plural else ' is'} #")
        needle_ids = []
        for n, k, _ in needles:
            name = f"{n} " if n else ""
            needle_ids.append(self._ids(f"The {name}pass key is #") + self._ids(k, space=False)
                              + self._ids(". Remember it. #", space=False) + self._ids(k, space=False)
                              + self._ids(f"is the {name}pass key."))
        budget = length - len(question) - sum(len(n) for n in needle_ids)
        order = sorted(range(len(needles)), key=lambda j: depths[j])  # placed in depth order
        asked_in_order = [needles[j][1] for j in order if needles[j][2]]
        answer = self._ids(", #".join(asked_in_order), space=False)
        budget -= len(answer)
        if budget < 0:
            raise DataError(
                f"a passkey sample of {length} tokens cannot hold its needles, question and answer "
                f"({length - budget} tokens with data.passkey.key_length={c.key_length}, num_needles="
                f"{c.num_needles}, num_distractors={c.num_distractors}); raise data.passkey.lengths or lower "
                "data.passkey.key_length")
        filler, bounds = self._filler(rng, budget)
        ids: list[int] = []
        starts = [0] * len(needles)
        prev = 0
        for j in order:
            cut = min(bounds, key=lambda b: (abs(b - depths[j] * budget), b))
            ids += filler[prev:cut]
            prev = cut
            starts[j] = len(ids)
            ids += needle_ids[j]
        ids += filler[prev:] + question
        answer_start = len(ids)
        ids += answer
        labels = [IGNORE_INDEX] * answer_start + answer
        return PasskeySample(ids, labels, asked_in_order, [starts[j] for j in order],
                             [depths[j] for j in order if needles[j][2]], budget, answer_start)

    def _filler(self, rng: random.Random, budget: int) -> tuple[list[int], list[int]]:
        """`budget` filler ids, and the sentence boundaries (0 and `budget` included)."""
        ids, bounds = [], [0]
        k = 0
        while len(ids) < budget:
            if self.cfg.filler == "repeat":
                s = self.sentences[k % len(self.sentences)]
                k += 1
            else:
                s = self.sentences[rng.randrange(len(self.sentences))]
            ids += s[:budget - len(ids)]
            bounds.append(len(ids))
        return ids, bounds


class PasskeyDataset(Sequence):
    """`num_samples` training samples; sample i's length is drawn from `lengths` and its depth from the range."""

    def __init__(self, task: PasskeyTask, lengths: list[int], num_samples: int, seed: int):
        self.task, self.lengths, self.num_samples, self.seed = task, list(lengths), num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> PasskeySample:
        if not isinstance(index, int):
            raise TypeError(f"PasskeyDataset indices must be int, got {type(index).__name__}")
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = random.Random(_seed_of("passkey", self.seed, index))
        return self.task.make(rng, rng.choice(self.lengths))

    def __getitem__(self, index: int) -> dict:
        return self.sample(index).as_item()


def grid_sample(task: PasskeyTask, seed: int, length: int, depth: float, j: int) -> PasskeySample:
    """Held-out sample j of the (length, depth) cell: its own stream, never a training sample's."""
    return task.make(random.Random(_seed_of("passkey-eval", seed, length, repr(float(depth)), j)), length, depth)


def passkey_lengths(data_cfg: Any) -> list[int]:
    return list(data_cfg.passkey.lengths) or [data_cfg.seq_len]


def _distinct_keys(rng: random.Random, kind: str, n_chars: int, count: int) -> list[str]:
    alphabet = "0123456789" if kind == "digits" else "abcdefghijklmnopqrstuvwxyz"
    if count > len(alphabet) ** n_chars:
        raise DataError(f"{count} distinct keys of data.passkey.key_length={n_chars} do not exist; raise "
                        "data.passkey.key_length")
    keys: list[str] = []
    while len(keys) < count:
        k = "".join(rng.choice(alphabet) for _ in range(n_chars))
        if k not in keys:
            keys.append(k)
    return keys


def _corpus_sentences(path) -> list[str]:
    from .tokenizer import DEMO_CORPUS
    out = []
    with open(path or DEMO_CORPUS) as f:
        for line in f:
            text = json.loads(line)["text"] if line.strip() else ""
            out += [s.strip() + "." for s in text.split(". ") if s.strip().rstrip(".")]
    return [s.replace("..", ".") for s in out]
