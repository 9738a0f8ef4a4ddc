"""Build ``torchtitan_neuron/assets/chat_test/``: the bundled chat set for the SFT recipes.

    .venv/bin/python scripts/build_chat_assets.py

Writes ``data.json`` (JSON lines, one conversation each: ``{"messages":
[{"role": "user", ...}, {"role": "assistant", ...}]}``) from arithmetic word
problems made here from templates and a fixed seed, so the set is the same
byte for byte on every run and holds no third-party text. Each answer shows
its working and ends with ``#### <result>``, the format of torchtitan's own
``sft_test`` sample. ``chat_template.jinja`` beside it is the template the
SFT loader formats each conversation with (the bundled tokenizer has none).
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "torchtitan_neuron" / "assets" / "chat_test"
COUNT = 1200
SEED = 20261207

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas",
         "Kemal", "Lena", "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
THINGS = ["apples", "books", "marbles", "stamps", "pencils", "cards", "shells", "coins",
          "stickers", "buttons", "tickets", "cookies"]


def problem(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    if kind == 0:
        return (f"What is {a} + {b}?", f"{a} + {b} = {a + b}. #### {a + b}")
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return (f"{name} has {a} {thing} and gives {b} to {other}. How many {thing} does "
                f"{name} have left?", f"{a} - {b} = {a - b}. #### {a - b}")
    if kind == 2:
        a, b = a % 12 + 2, b % 12 + 2
        return (f"What is {a} * {b}?", f"{a} * {b} = {a * b}. #### {a * b}")
    if kind == 3:
        boxes, each = a % 9 + 2, b % 11 + 2
        return (f"{name} packs {boxes} boxes with {each} {thing} in each. How many {thing} "
                "is that in total?", f"{boxes} * {each} = {boxes * each}. #### {boxes * each}")
    if kind == 4:
        per, groups = a % 9 + 2, b % 9 + 2
        total = per * groups
        return (f"{total} {thing} are shared equally among {groups} friends. How many does "
                "each friend get?", f"{total} / {groups} = {per}. #### {per}")
    c = rng.randint(2, 30)
    return (f"{name} had {a} {thing}, found {b} more and then lost {c}. How many {thing} "
            f"are there now?", f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. "
            f"#### {a + b - c}")


TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def main() -> None:
    rng = random.Random(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "data.json", "w") as f:
        for _ in range(COUNT):
            question, answer = problem(rng)
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    (OUT / "chat_template.jinja").write_text(TEMPLATE + "\n")


if __name__ == "__main__":
    main()
