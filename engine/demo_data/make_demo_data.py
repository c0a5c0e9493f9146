"""Rebuilds the shipped demo data: `corpus.jsonl` and the byte-level BPE `tokenizer/` trained on it.

Run from the repository root (offline, a few seconds, deterministic):

    .venv/bin/python engine/demo_data/make_demo_data.py

The corpus is original prose assembled from the word lists and sentence templates below, about an invented
harbour village through the seasons. It exists so that `data=demo` trains a tiny model on real-looking
English without any download; its content has no value beyond that. The tokenizer has 512 entries (256 byte
symbols, one special token `<|endoftext|>` used as eos and pad, 255 merges) to match the tiny demo model's
`model.arch.vocab_size=512`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261129
NUM_PARAGRAPHS = 480
VOCAB_SIZE = 512
EOS = "<|endoftext|>"

# Mirrors engine.data.chat.BUILTIN_CHAT_TEMPLATE; kept as a literal so this script runs on its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if eos_token %}{{ eos_token }}{% else %}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

NAMES = [
    "Mara", "Tobin", "Ilse", "Odo", "Pella", "Rufus", "Senna", "Brann", "Wren", "Hale",
    "Nell", "Corin", "Dara", "Fenn", "Greta", "Jory", "Lina", "Milo", "Orla", "Pim",
]
JOBS = [
    "baker", "net mender", "lamp keeper", "gardener", "ferry pilot", "potter", "teacher",
    "boat builder", "beekeeper", "weaver", "miller", "harbour master",
]
PLACES = [
    "the harbour", "the old mill", "the market square", "the lighthouse", "the orchard",
    "the bakery on Shell Street", "the north pier", "the chapel garden", "the salt marsh",
    "the school by the dunes", "the ferry landing", "the hill above the village",
]
SEASONS = {
    "spring": {
        "weather": ["a soft rain", "a cool wind from the sea", "a pale, bright sun", "low grey clouds"],
        "sight": ["the first swallows", "green shoots in the furrows", "apple blossom", "lambs on the hill"],
        "task": ["planting beans", "painting the boats", "mending the fences", "sowing the herb beds"],
        "food": ["nettle soup", "fresh radishes", "warm oat bread", "spring onions"],
    },
    "summer": {
        "weather": ["a long, hot afternoon", "a still and hazy morning", "a warm breeze", "a sudden thunderstorm"],
        "sight": ["children on the sand", "sails far out on the water", "bees in the lavender", "ripe cherries"],
        "task": ["drying fish on the racks", "cutting hay", "tarring the hulls", "carrying water to the beds"],
        "food": ["grilled mackerel", "strawberries", "cold cucumber soup", "honey cakes"],
    },
    "autumn": {
        "weather": ["a gusty wind", "a thick morning fog", "a clear, cold evening", "steady rain"],
        "sight": ["geese flying south", "red leaves in the gutters", "full baskets of apples", "dark seas"],
        "task": ["pressing apples", "stacking firewood", "hauling the small boats ashore", "storing potatoes"],
        "food": ["apple pie", "roasted chestnuts", "pumpkin stew", "smoked herring"],
    },
    "winter": {
        "weather": ["a hard frost", "a quiet snowfall", "a bitter north wind", "a short, pale day"],
        "sight": ["ice along the pier", "smoke from every chimney", "robins at the window", "stars over the bay"],
        "task": ["repairing the nets", "carving new oars", "knitting by the stove", "checking the moorings"],
        "food": ["barley broth", "baked turnips", "spiced tea", "dark rye bread"],
    },
}
FEELINGS = ["glad", "tired but content", "a little worried", "cheerful", "thoughtful", "proud", "calm"]
OBJECTS = ["a lantern", "a basket", "a coil of rope", "a clay jug", "a small notebook", "a wooden box"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "ten", "twelve"]

OPENINGS = [
    "In {season}, {place} woke to {weather}.",
    "It was {season} in the village, and {weather} lay over {place}.",
    "{name} the {job} walked down to {place} on a {season} morning.",
    "Every {season} the people of the village spent their days {task}.",
    "The {season} had come early that year, bringing {weather}.",
]
MIDDLES = [
    "{name} carried {object} and stopped to watch {sight}.",
    "Near {place}, {name} met {name2}, who was busy {task}.",
    "{name2} said that {weather} was good for {task}, and {name} agreed.",
    "By noon there were {number} people at {place}, all of them {task}.",
    "The {job} counted {number} boats in the harbour and wrote the number down.",
    "{name} had learned from {name2} how to make {food}, and made it every {season}.",
    "Someone had left {object} by the door of {place}.",
    "The children pointed at {sight} and laughed.",
    "Work went slowly, because {weather} made everything harder.",
    "{name2} brought {food} for everyone who was {task}.",
    "From {place} you could see {sight} and, far away, the grey line of the islands.",
    "{name} asked {name2} whether the ferry would run, and {name2} said it would if the wind dropped.",
    "The old {job} told a story about one {season} long ago, when the bay froze from shore to shore.",
    "There were {number} loaves left at the bakery, and {name} bought two of them.",
]
CLOSINGS = [
    "When evening came, {name} went home feeling {feeling}.",
    "That night the village ate {food} and went to bed early.",
    "Later, {name} wrote in {possessive} notebook that it had been a good day.",
    "The lamp at the lighthouse was lit at dusk, as it is every night.",
    "Tomorrow, {name} thought, there would be more {task_gerund_obj}.",
    "By the time the stars came out, {place} was quiet again.",
]


def _paragraph(rng: random.Random) -> str:
    season = rng.choice(sorted(SEASONS))
    s = SEASONS[season]
    name, name2 = rng.sample(NAMES, 2)
    slots = {
        "season": season,
        "name": name,
        "name2": name2,
        "job": rng.choice(JOBS),
        "place": rng.choice(PLACES),
        "weather": rng.choice(s["weather"]),
        "sight": rng.choice(s["sight"]),
        "task": rng.choice(s["task"]),
        "food": rng.choice(s["food"]),
        "feeling": rng.choice(FEELINGS),
        "object": rng.choice(OBJECTS),
        "number": rng.choice(NUMBERS),
        "possessive": rng.choice(["her", "his", "their"]),
        "task_gerund_obj": rng.choice(["work to do", "nets to mend", "bread to bake", "boats to watch"]),
    }
    sentences = [rng.choice(OPENINGS)]
    sentences += rng.sample(MIDDLES, rng.randint(2, 6))
    sentences.append(rng.choice(CLOSINGS))
    text = " ".join(t.format(**slots) for t in sentences)
    return text[0].upper() + text[1:]


def make_corpus(path: Path) -> list[str]:
    rng = random.Random(SEED)
    texts = [_paragraph(rng) for _ in range(NUM_PARAGRAPHS)]
    with path.open("w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return texts


def make_tokenizer(texts: list[str], out_dir: Path) -> None:
    # Imported here so that reading the corpus code needs nothing beyond the standard library.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, so no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE, model_max_length=1 << 20
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))


def main() -> None:
    texts = make_corpus(HERE / "corpus.jsonl")
    make_tokenizer(texts, HERE / "tokenizer")
    size = (HERE / "corpus.jsonl").stat().st_size
    print(f"wrote {len(texts)} paragraphs ({size / 1024:.0f} KiB) and a {VOCAB_SIZE}-entry tokenizer under {HERE}")


if __name__ == "__main__":
    main()
