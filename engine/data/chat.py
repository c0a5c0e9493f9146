"""Chat rendering with assistant-only labels.

The conversation is rendered once with the tokenizer's chat template; those tokens are the sample. Each
assistant turn's span is found by rendering the prefixes and diffing lengths:

    start = len(render(messages[:i], add_generation_prompt=True))   # after the assistant header
    end   = len(render(messages[:i + 1]))                            # after the turn's end token

and only `full[start:end]` keeps its labels (content + end-of-turn token); system and user turns, role headers
and the template's scaffolding are -100. Diffing the template's own output, rather than searching for marker
strings, works for any template. Some templates are not prefix-stable (a BPE merge across a turn boundary, or
history rendered differently from the last turn); each boundary is then placed where the prefix rendering stops
matching the full one (longest common prefix), so only the tokens that differ can land on the wrong side, and
the chat is counted (`DataStats.num_chat_boundary_mismatches`) so it shows in the data summary. Cost:
O(turns^2) tokenisation per conversation, fine for ordinary chats.

A tokenizer without a chat template gets `BUILTIN_CHAT_TEMPLATE` (`<|role|>\\ncontent<eos>` per message), and
a log line says so.
"""

from __future__ import annotations

from .batch import IGNORE_INDEX

ROLES = ("system", "user", "assistant")

BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if eos_token %}{{ eos_token }}{% else %}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenize_chat(
    tokenizer, messages: list[dict], chat_template: str | None = None
) -> tuple[list[int], list[int], bool]:
    """Returns (input_ids, labels, prefix_stable) for a validated conversation of system/user/assistant turns.

    `chat_template=None` uses the tokenizer's own template. `prefix_stable` is False when some prefix rendering
    was not a token prefix of the full rendering (see the module docstring).
    """
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = _render(tokenizer, msgs, chat_template, add_generation_prompt=False)
    labels = [IGNORE_INDEX] * len(full)
    stable = True
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        # A conversation cannot be rendered empty, so a leading assistant turn trains on its header too.
        start = 0
        if i > 0:
            head = _render(tokenizer, msgs[:i], chat_template, add_generation_prompt=True)
            start = _common_prefix_len(full, head)
            stable &= start == len(head)
        last = i == len(msgs) - 1
        turn = full if last else _render(tokenizer, msgs[: i + 1], chat_template, add_generation_prompt=False)
        end = _common_prefix_len(full, turn)
        stable &= end == len(turn)
        labels[start:end] = full[start:end]
    return full, labels, stable


def _render(tokenizer, msgs: list[dict], chat_template: str | None, *, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        msgs,
        chat_template=chat_template,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
    )
    if hasattr(out, "keys"):  # some versions return a BatchEncoding whatever return_dict says
        out = out["input_ids"]
    return [int(t) for t in out]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
