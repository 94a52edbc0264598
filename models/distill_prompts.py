"""The draft distillation's prompt set, ``models/distill_prompts.jsonl``, built from templates and the
Python standard library's own source, so any machine can rebuild it offline:

    python -m models.distill_prompts            # rewrites models/distill_prompts.jsonl

Four classes, as many prompts each: ``code`` (functions named and documented in the stdlib, snippets to
explain, annotate or test), ``json`` (templates to fill, descriptions to convert), ``math`` (word problems
with drawn numbers) and ``chat`` (open questions, writing tasks). One prompt in five of each class is held
out: the trainer never generates from it, ``python -m models.distill --eval`` measures agreement on it.
Seeded throughout: the same Python (its stdlib is content here) writes the same file.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).resolve().parent / "distill_prompts.jsonl"
CLASSES = ("code", "json", "math", "chat")
HELDOUT_EVERY = 5  # one prompt in five of each class is held out
# Small modules whose functions read well as tasks; read as files, never imported.
STDLIB_MODULES = ("textwrap", "string", "heapq", "bisect", "fnmatch", "shlex", "base64", "colorsys", "calendar",
                  "statistics", "difflib", "glob", "posixpath", "html/__init__", "json/encoder", "csv", "copy",
                  "functools", "random", "ipaddress", "urllib/parse", "email/utils", "gettext", "operator", "locale")

GENERIC_TASKS = ("reverses the words in a sentence", "checks whether a string is a palindrome",
                 "merges two sorted lists", "counts the vowels in a text", "flattens a nested list",
                 "returns the n-th Fibonacci number", "removes duplicates while keeping order",
                 "parses a date like 2024-03-15 into a tuple", "groups words by their first letter",
                 "finds the longest common prefix of several strings", "rotates a matrix by 90 degrees",
                 "converts Roman numerals to integers", "validates an e-mail address with a regex",
                 "chunks a list into pieces of size n", "computes a running average",
                 "reads a CSV file and sums one column", "implements binary search",
                 "checks that brackets in a string are balanced")
ENTITIES: dict[str, tuple[str, ...]] = {
    "person": ("name", "age", "email", "city", "is_member"),
    "book": ("title", "author", "year", "isbn", "genres"),
    "product": ("sku", "name", "price", "currency", "in_stock"),
    "city": ("name", "country", "population", "timezone", "landmarks"),
    "event": ("title", "date", "start_time", "location", "attendees"),
    "recipe": ("name", "servings", "prep_minutes", "ingredients", "vegetarian"),
    "server": ("hostname", "ip", "port", "tls", "replicas"),
    "movie": ("title", "director", "year", "runtime_minutes", "rating"),
    "invoice": ("number", "customer", "total", "due_date", "paid"),
    "weather report": ("city", "temperature_c", "humidity", "wind_kmh", "conditions"),
}
NAMES = ("Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Giulia", "Hiro", "Ines", "Jonas", "Kofi", "Lena")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Lima", "Oslo", "Toronto", "Hanoi", "Krakow", "Austin", "Cairo")
ITEMS = ("apples", "pencils", "notebooks", "tickets", "cookies", "marbles", "stamps", "bottles of water")
TOPICS = ("learning a new language", "running a first marathon", "keeping houseplants alive", "saving money",
          "sleeping better", "writing clean code", "giving a talk", "cooking for a crowd", "remote work",
          "studying for exams", "starting a vegetable garden", "travelling on a budget", "reading more books")
PAIRS = (("a list", "a tuple"), ("weather", "climate"), ("a virus", "a bacterium"), ("TCP", "UDP"),
         ("stocks", "bonds"), ("a compiler", "an interpreter"), ("speed", "velocity"), ("RAM", "disk storage"),
         ("baking soda", "baking powder"), ("a process", "a thread"), ("mean", "median"), ("HTTP", "HTTPS"))
CONCEPTS = ("photosynthesis", "recursion", "inflation", "gravity", "public-key encryption", "the water cycle",
            "machine learning", "supply and demand", "DNS", "version control", "vaccines", "black holes")
THINGS = ("the ocean", "a rainy Monday", "an old lighthouse", "autumn leaves", "a cup of coffee", "the city at night",
          "a lost umbrella", "the first snow", "a quiet library", "a mountain trail")


@dataclass(frozen=True)
class Prompt:
    """One chat prompt: a single user message, its class and whether it is held out."""

    id: str
    cls: str
    split: str  # "train" or "heldout"
    user: str

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "class": self.cls, "split": self.split,
                           "messages": [{"role": "user", "content": self.user}]}, ensure_ascii=False)


def load_prompts(path: Path = PROMPTS_PATH) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        raw = json.loads(line)
        messages = raw["messages"]
        if raw["class"] not in CLASSES or raw["split"] not in ("train", "heldout") or len(messages) != 1:
            raise ValueError(f"{path}:{n}: not a prompt of this set: {line[:80]}")
        prompts.append(Prompt(raw["id"], raw["class"], raw["split"], messages[0]["content"]))
    return prompts


# -- stdlib content ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StdlibFunction:
    module: str
    name: str
    signature: str
    summary: str  # the docstring's first line
    source: str  # dedented


def stdlib_functions(max_lines: int = 18) -> list[StdlibFunction]:
    """Public, documented, short functions of STDLIB_MODULES, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for module in STDLIB_MODULES:
        path = root / f"{module}.py"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for node in ast.parse(text).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not doc:
                continue
            assert node.end_lineno is not None
            if node.end_lineno - node.lineno + 1 > max_lines:
                continue
            summary = doc.strip().splitlines()[0].strip().rstrip(".")
            found.append(StdlibFunction(module.replace("/__init__", "").replace("/", "."), node.name,
                                        f"{node.name}({ast.unparse(node.args)})", summary,
                                        "".join(lines[node.lineno - 1:node.end_lineno])))
    return found


# -- the four classes -----------------------------------------------------------------------------------------
def code_prompts(rng: random.Random, count: int, functions: Sequence[StdlibFunction]) -> list[str]:
    def write(f: StdlibFunction) -> str:
        return f"Write a Python function `{f.signature}`: {f.summary}."

    def explain(f: StdlibFunction) -> str:
        return f"Explain what this function from `{f.module}` does:\n```python\n{f.source}```"

    def annotate(f: StdlibFunction) -> str:
        return f"Add type hints to this Python function and keep its behaviour:\n```python\n{f.source}```"

    def test(f: StdlibFunction) -> str:
        return f"Write pytest unit tests for `{f.module}.{f.name}`:\n```python\n{f.source}```"

    def generic(_: StdlibFunction) -> str:
        return f"Write a Python function that {rng.choice(GENERIC_TASKS)}. Include a short docstring."

    makers: tuple[Callable[[StdlibFunction], str], ...] = (write, write, explain, annotate, test, generic)
    return [rng.choice(makers)(rng.choice(functions)) for _ in range(count)]


def _json_value(rng: random.Random, field: str) -> object:
    if field in ("age", "year", "population", "servings", "prep_minutes", "port", "replicas", "runtime_minutes"):
        return rng.randint(2, 2025)
    if field in ("price", "total", "rating", "temperature_c", "humidity", "wind_kmh"):
        return round(rng.uniform(1, 99), 1)
    if field.startswith(("is_", "in_")) or field in ("tls", "paid", "vegetarian"):
        return rng.random() < 0.5
    if field in ("name", "customer", "author"):
        return f"{rng.choice(NAMES)} {rng.choice(CITIES)}"
    return rng.choice(CITIES)


def json_prompts(rng: random.Random, count: int) -> list[str]:
    prompts = []
    for _ in range(count):
        entity = rng.choice(sorted(ENTITIES))
        fields = ENTITIES[entity]
        kind = rng.randrange(4)
        if kind == 0:
            template = json.dumps(dict.fromkeys(fields), indent=2)
            prompts.append(f"Fill in this JSON template for a {entity}, with plausible values. "
                           f"Reply with JSON only.\n{template}")
        elif kind == 1:
            facts = "; ".join(f"{f.replace('_', ' ')} is {_json_value(rng, f)}" for f in fields[:4])
            prompts.append(f"Convert this description of a {entity} into a JSON object with the keys "
                           f"{', '.join(fields[:4])}: {facts}.")
        elif kind == 2:
            prompts.append(f"Return a JSON array of {rng.randint(2, 4)} {entity} objects, each with the fields "
                           f"{', '.join(fields)}.")
        else:
            record = {f: _json_value(rng, f) for f in fields}
            prompts.append(f"Write a JSON Schema that validates objects like this {entity}:\n"
                           f"{json.dumps(record)}")
    return prompts


def math_prompts(rng: random.Random, count: int) -> list[str]:
    def shop() -> str:
        n, price, paid = rng.randint(3, 24), rng.randint(2, 15), rng.choice((50, 100, 200))
        return (f"{rng.choice(NAMES)} buys {n} {rng.choice(ITEMS)} at ${price} each and pays with a ${paid} bill. "
                "How much change does she get, if any?")

    def travel() -> str:
        speed, hours = rng.randint(40, 120), rng.randint(2, 9)
        return (f"A train leaves {rng.choice(CITIES)} at {speed} km/h and travels for {hours} hours, then "
                f"{rng.randint(1, 3)} more hours at {speed + rng.randint(5, 30)} km/h. How far does it go in total?")

    def percent() -> str:
        price, off = rng.randint(20, 400), rng.choice((10, 15, 20, 25, 30, 40))
        return f"A jacket costs ${price}. It is {off}% off, then 8% tax is added. What is the final price?"

    def area() -> str:
        w, h = rng.randint(3, 30), rng.randint(3, 30)
        return (f"A rectangular garden is {w} m by {h} m. A path 1 m wide runs around the outside. "
                "What is the area of the path?")

    def average() -> str:
        scores = [rng.randint(50, 100) for _ in range(rng.randint(4, 7))]
        return f"The test scores are {', '.join(map(str, scores))}. What score on the next test raises the mean by 2?"

    def ages() -> str:
        younger, diff, later = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 10)
        older, other = rng.sample(NAMES, 2)
        return (f"{older} is {diff} years older than {other}. In {later} years "
                f"their ages will add up to {2 * younger + diff + 2 * later}. How old is each now?")

    def interest() -> str:
        p, r, t = rng.choice((500, 1000, 2500, 8000)), rng.choice((2, 3, 4, 5, 6)), rng.randint(2, 10)
        return f"${p} is invested at {r}% simple interest per year for {t} years. What is the total at the end?"

    def recipe() -> str:
        a, b, c = rng.randint(2, 6), rng.randint(7, 20), rng.randint(150, 600)
        return f"A recipe for {a} people needs {c} g of flour. How much flour is needed for {b} people?"

    makers = (shop, travel, percent, area, average, ages, interest, recipe)
    return [rng.choice(makers)() + " Solve it step by step." for _ in range(count)]


def chat_prompts(rng: random.Random, count: int, functions: Sequence[StdlibFunction]) -> list[str]:
    makers: tuple[Callable[[], str], ...] = (
        lambda: f"Give me {rng.randint(3, 7)} tips for {rng.choice(TOPICS)}.",
        lambda: "What is the difference between {} and {}?".format(*rng.choice(PAIRS)),
        lambda: f"Write a short poem about {rng.choice(THINGS)}.",
        lambda: f"Explain {rng.choice(CONCEPTS)} in simple terms.",
        lambda: f"Write a friendly email to {rng.choice(NAMES)} asking to move our meeting about "
                f"{rng.choice(TOPICS)} to {rng.choice(('Monday', 'Thursday', 'next week'))}.",
        lambda: f"I am visiting {rng.choice(CITIES)} for {rng.randint(2, 5)} days. What should I see?",
        lambda: f"Summarize in one sentence what the Python module `{rng.choice(functions).module}` is for.",
        lambda: f"Tell me a short story about {rng.choice(NAMES)} and {rng.choice(THINGS)}.",
        lambda: f"What are the pros and cons of {rng.choice(TOPICS)}?",
    )
    return [rng.choice(makers)() for _ in range(count)]


def build_prompts(per_class: int = 100, seed: int = 0) -> list[Prompt]:
    """The whole set: ``per_class`` prompts of each class, every HELDOUT_EVERY-th of a shuffled order held out."""
    rng = random.Random(seed)
    functions = stdlib_functions()
    if not functions:
        raise RuntimeError("no stdlib functions found: is the standard library's source installed?")
    texts = {"code": code_prompts(rng, per_class, functions), "json": json_prompts(rng, per_class),
             "math": math_prompts(rng, per_class), "chat": chat_prompts(rng, per_class, functions)}
    prompts = []
    for cls in CLASSES:
        order = list(range(per_class))
        rng.shuffle(order)
        heldout = {order[i] for i in range(0, per_class, HELDOUT_EVERY)}
        prompts += [Prompt(f"{cls}-{i:03d}", cls, "heldout" if i in heldout else "train", text)
                    for i, text in enumerate(texts[cls])]
    return prompts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROMPTS_PATH)
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = build_prompts(args.per_class, args.seed)
    args.out.write_text("".join(p.to_json() + "\n" for p in prompts), encoding="utf-8")
    print(f"{args.out}: {len(prompts)} prompts", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
