"""The data layer: datasets of unshifted samples, the layout-independent step sampler, and batching.

    ds, stats, tok = build_dataset(cfg.data, seed=cfg.run.seed, vocab_size=cfg.model.arch.vocab_size)
    sampler = GlobalBatchSampler(len(ds), cfg.trainer.global_batch_size, seed=cfg.run.seed)
    for mb in sampler.local_indices(step, dp_rank, dp_size, cfg.trainer.micro_batch_size):
        batch = collate([ds[i] for i in mb], cfg.data.seq_len, pad_id_of(tok))

The normaliser of step `step` is `count_target_tokens` summed over the samples of
`sampler.indices_for_step(step)`; every rank can compute it locally, before any backward, with no collective.

Resume: the sampler is stateless in the step (step k's indices depend only on the dataset size, global batch
size, seed and k), so a checkpoint only needs the step number to resume the data stream exactly.
"""

from .batch import IGNORE_INDEX, collate, count_target_tokens
from .build import build_dataset
from .chat import BUILTIN_CHAT_TEMPLATE, tokenize_chat
from .errors import DataError
from .sampler import GlobalBatchSampler
from .stats import DataStats
from .synthetic import SyntheticDataset
from .tokenizer import DEMO_CORPUS, DEMO_TOKENIZER, load_tokenizer, pad_id_of

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "DEMO_CORPUS",
    "DEMO_TOKENIZER",
    "IGNORE_INDEX",
    "DataError",
    "DataStats",
    "GlobalBatchSampler",
    "SyntheticDataset",
    "build_dataset",
    "collate",
    "count_target_tokens",
    "load_tokenizer",
    "pad_id_of",
    "tokenize_chat",
]
