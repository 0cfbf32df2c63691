"""Prompts a draft head is trained on: written here from templates and subjects, seeded, so that many hundreds of
different requests come from a few lines, none of them taken from a benchmark set. They cover what a chat server is
asked (writing, explaining, advice, comparisons, role play, reasoning, arithmetic word problems, code, extraction and
editing of a given text) in the forms MT-Bench-like chats take, and the answers are the served model's own."""
from __future__ import annotations

import random

SUBJECTS = (
    "volcanoes", "the history of the printing press", "honey bees", "electric cars", "the Roman roads",
    "learning the piano", "city gardens", "the moon's phases", "remote work", "public libraries", "recycling plastic",
    "the human heart", "chess openings", "mountain hiking", "coffee farming", "the invention of the telephone",
    "solar panels", "sleep and memory", "street markets", "ocean tides", "board games with children",
    "saving money on groceries", "the first airplanes", "winter cycling", "birds that migrate", "baking sourdough",
    "open source software", "the water cycle", "museums", "rainforests", "train travel in Europe", "spreadsheets",
    "first aid at home", "the Olympic games", "penguins", "lighthouses", "composting", "time zones",
    "public speaking", "paper money", "earthquakes", "desert plants", "the periodic table", "video calls",
)
AUDIENCES = ("a ten-year-old", "a new employee", "a retired teacher", "a university student", "a busy parent",
             "someone who has never used a computer")
FORMS = ("a short poem", "a short story", "a blog post introduction", "a friendly email", "a product description",
         "a two-paragraph essay", "a speech opening", "a diary entry", "a limerick", "a news headline and summary")
ROLES = ("a ship's captain", "a museum guide", "a patient librarian", "a football coach", "a medieval baker",
         "a travel agent", "a detective", "a gardener")
CODE_TASKS = (
    "reverses the words of a sentence", "returns the second largest number of a list",
    "checks whether two strings are anagrams", "merges two sorted lists into one sorted list",
    "counts the vowels in a string", "returns the n-th Fibonacci number iteratively",
    "removes duplicates from a list while keeping the order", "converts a temperature from Celsius to Fahrenheit",
    "finds the most common character of a string", "groups a list of words by their first letter",
    "computes the running average of a list of numbers", "flattens a list of lists",
    "checks whether a year is a leap year", "returns the prime numbers below n",
    "splits a list into chunks of size k", "capitalises the first letter of every word",
    "computes the greatest common divisor of two numbers", "parses 'key=value' pairs separated by semicolons",
    "rotates a list by k positions", "returns the longest word in a sentence",
)
LANGUAGES = ("Python", "JavaScript", "Python", "Python", "C", "Go")
ITEMS = (("apples", "kilogram"), ("notebooks", "pack"), ("tickets", "ticket"), ("tiles", "box"),
         ("candles", "candle"), ("seeds", "bag"))
NAMES = ("Lena", "Omar", "Priya", "Tom", "Keiko", "Mateo", "Ada", "Sam")


def _writing(rng: random.Random) -> str:
    return f"Write {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}."


def _explain(rng: random.Random) -> str:
    return f"Explain {rng.choice(SUBJECTS)} to {rng.choice(AUDIENCES)}."


def _advice(rng: random.Random) -> str:
    return f"Give me {rng.randint(3, 7)} practical tips about {rng.choice(SUBJECTS)}, one or two sentences each."


def _compare(rng: random.Random) -> str:
    first, second = rng.sample(SUBJECTS, 2)
    return f"Compare {first} and {second}: what do they have in common, and how do they differ?"


def _pros_cons(rng: random.Random) -> str:
    return f"What are the advantages and disadvantages of {rng.choice(SUBJECTS)}? Answer with two short lists."


def _role_play(rng: random.Random) -> str:
    return f"Pretend you are {rng.choice(ROLES)}. Tell a visitor what you find most interesting about " \
           f"{rng.choice(SUBJECTS)}."


def _arithmetic(rng: random.Random) -> str:
    name, (item, unit) = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, paid = rng.randint(2, 12), rng.randint(2, 9), rng.choice((50, 100))
    return f"{name} buys {count} {item} at {price} dollars per {unit} and pays with a {paid} dollar note. " \
           f"How much change does {name} get? Explain each step."


def _rate(rng: random.Random) -> str:
    distance, hours, more = rng.randint(2, 9) * 30, rng.randint(2, 5), rng.randint(3, 8)
    return f"A cyclist rides {distance} kilometres in {hours} hours. At the same speed, how far does the cyclist " \
           f"ride in {more} hours? Show your working."


def _code(rng: random.Random) -> str:
    return f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}, with a short explanation."


def _code_fix(rng: random.Random) -> str:
    name = rng.choice(("total", "count", "result", "value"))
    return "Find the bug in this Python code, explain it and return the corrected code:\n\n" \
           f"def average(numbers):\n    {name} = 0\n    for n in numbers:\n        {name} += n\n" \
           f"    return {name} / len(numbers) + 1\n"


def _extract(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    day, city = rng.choice(("Monday", "Wednesday", "Friday")), rng.choice(("Lisbon", "Oslo", "Nairobi", "Quito"))
    return "Extract the people, the day and the place from this note as JSON:\n\n" \
           f"{name} will meet {other} in {city} on {day} to plan a workshop about {rng.choice(SUBJECTS)}."


def _rewrite(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    return f"Rewrite this sentence in a formal tone and then in a playful tone: 'I think {subject} is pretty " \
           "cool and more people should know about it.'"


def _reasoning(rng: random.Random) -> str:
    first, second, third = rng.sample(NAMES, 3)
    return f"{first} is taller than {second}, and {second} is taller than {third}. Who is the shortest? " \
           "Explain your reasoning step by step."


TEMPLATES = (_writing, _explain, _advice, _compare, _pros_cons, _role_play, _arithmetic, _rate, _code, _code_fix,
             _extract, _rewrite, _reasoning)


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """COUNT different prompts, the templates taken in turn, each filled at random (seeded)."""
    rng, prompts, seen = random.Random(seed), [], set()
    attempts = 0
    while len(prompts) < count and attempts < 50 * count:
        text = TEMPLATES[attempts % len(TEMPLATES)](rng)
        attempts += 1
        if text not in seen:
            seen.add(text)
            prompts.append(text)
    return prompts
