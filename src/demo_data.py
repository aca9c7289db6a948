"""The built-in demo task: synthetic movie-review sentiment that a bag of words cannot solve.

Every sentence pairs one positive and one negative adjective, and its label is decided by word order
and negation ("good, not bad" vs "bad, not good"). Each template has a twin with the same words and
the opposite label, so word counts alone sit at chance and the model has to read the sentence.
"""

import random

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

POSITIVE = ["good", "great", "wonderful", "brilliant", "delightful", "superb", "charming", "gripping", "fun", "moving"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "dull", "weak", "clumsy", "tedious", "bland", "lifeless"]
SUBJECTS = [
    "the movie",
    "the film",
    "the plot",
    "the acting",
    "the script",
    "the ending",
    "the soundtrack",
    "the dialogue",
    "the cast",
    "the direction",
    "the pacing",
    "the story",
]

# (template, which adjective decides the label): "first" is {a}, "second" is {b}.
TEMPLATES = [
    ("{s} was {a} , not {b}", "first"),
    ("{s} was not {a} but {b}", "second"),
    ("{s} was {a} rather than {b}", "first"),
    ("i expected {s} to be {a} , but it was {b}", "second"),
    ("{s} was far from {a} ; it was {b}", "second"),
    ("{s} was {a} , and never {b}", "first"),
]
LABEL_NAMES = ["negative", "positive"]


def _sentence(rng: random.Random) -> tuple[str, int]:
    template, decider = rng.choice(TEMPLATES)
    label = rng.randrange(2)
    decisive = rng.choice(POSITIVE if label else NEGATIVE)
    other = rng.choice(NEGATIVE if label else POSITIVE)
    a, b = (decisive, other) if decider == "first" else (other, decisive)
    return template.format(s=rng.choice(SUBJECTS), a=a, b=b), label


def make_demo_splits(num_train: int = 2000, num_validation: int = 500, seed: int = 0) -> DatasetDict:
    """The same sentences for the same arguments on every machine and rank."""
    rng = random.Random(seed)
    features = Features({"sentence": Value("string"), "label": ClassLabel(names=LABEL_NAMES)})
    splits = {}
    for name, size in (("train", num_train), ("validation", num_validation)):
        sentences, labels = zip(*(_sentence(rng) for _ in range(size)))
        splits[name] = Dataset.from_dict({"sentence": list(sentences), "label": list(labels)}, features=features)
    return DatasetDict(splits)
