"""A deterministic procedural generator of short children's stories (TinyStories-like English).

No dataset can be downloaded on the machines this project is built on, so the default training corpus is
generated: a small grammar of characters, places, wishes, problems, helpers and endings, with consistent
pronouns and names inside a story, dialogue, and a closing line. Every story comes from one
``random.Random`` seeded with ``(seed, index)``, so the text is identical on every machine and Python
version (``random.Random`` with an integer seed is stable across CPython releases), and any story can be
regenerated on its own.

It is *not* natural text: the vocabulary is a few hundred words and the plots follow a handful of
templates, so a model's bits-per-byte on it is far lower than on enwik8 or real TinyStories and is not
comparable with published numbers. It is real English with long-range structure (a name introduced in
the first sentence recurs at the end; quoted speech opens and closes), which is what a byte-level
language model needs to show learning in a few minutes of CPU.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

GENERATOR_VERSION = 1
"""Bumped whenever the generated text changes (it is part of the cache key and of the recorded corpus)."""

_NAMES = {
    "she": ["Lily", "Mia", "Sara", "Anna", "Zoe", "Ella", "Lucy", "Nina", "Ruby", "Emma", "Maya", "Rosa",
            "Ivy", "Kate", "Amy", "Jane", "Lena", "Tara"],
    "he": ["Tom", "Ben", "Max", "Leo", "Sam", "Jack", "Tim", "Finn", "Noah", "Omar", "Luke", "Eli",
           "Jake", "Ravi", "Hugo", "Dan", "Paul", "Theo"],
}
_ANIMALS = [
    ("cat", "she"), ("dog", "he"), ("bunny", "she"), ("bear", "he"), ("duck", "she"), ("fox", "he"),
    ("frog", "he"), ("owl", "she"), ("mouse", "she"), ("pig", "he"), ("bird", "she"), ("turtle", "he"),
    ("lion", "he"), ("sheep", "she"), ("squirrel", "he"), ("puppy", "she"),
]
_ADJ_CHAR = ["little", "happy", "curious", "brave", "shy", "kind", "silly", "tiny", "clever", "sleepy",
             "friendly", "busy", "gentle", "playful"]
_PLACES = [
    ("park", "in the park"), ("forest", "in the big forest"), ("garden", "in the garden"),
    ("beach", "at the beach"), ("farm", "on the farm"), ("house", "in a small house"),
    ("town", "in a quiet town"), ("school", "at school"), ("pond", "near the pond"),
    ("hill", "on a green hill"), ("river", "by the river"), ("meadow", "in a sunny meadow"),
]
_OBJECTS = [
    ("ball", "red"), ("kite", "blue"), ("hat", "yellow"), ("toy car", "shiny"), ("book", "old"),
    ("cake", "sweet"), ("flower", "pink"), ("box", "big"), ("boat", "little"), ("drum", "loud"),
    ("shell", "pretty"), ("balloon", "green"), ("key", "gold"), ("blanket", "soft"), ("stone", "smooth"),
    ("apple", "juicy"), ("cup", "white"), ("bell", "silver"),
]
_FEELINGS_GOOD = ["happy", "glad", "proud", "excited", "thankful", "calm", "cheerful"]
_FEELINGS_BAD = ["sad", "scared", "worried", "upset", "lonely", "angry", "tired"]
_WEATHER = ["The sun was bright.", "It was a warm day.", "The wind was blowing.", "It was raining a little.",
            "The sky was blue and clear.", "It was a cold morning.", "The stars were out."]
_ACTIVITIES = ["play", "run", "jump", "sing", "dance", "explore", "draw", "read", "swim", "climb"]
_MORALS = [
    "Sharing makes everyone happy.", "It is good to help your friends.", "Being kind is the best thing.",
    "You should always say sorry when you are wrong.", "Friends are there for each other.",
    "Trying again is how we learn.", "It is brave to ask for help.", "Listening to others is important.",
]
_OPENINGS = ["Once upon a time,", "One day,", "Long ago,", "One sunny morning,", "Once,", "Last summer,",
             "One evening,"]


def _pron(gender: str) -> dict[str, str]:
    if gender == "she":
        return {"subj": "she", "obj": "her", "pos": "her", "Subj": "She", "Pos": "Her"}
    return {"subj": "he", "obj": "him", "pos": "his", "Subj": "He", "Pos": "His"}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _character(rng: random.Random) -> dict[str, str]:
    """A named child or a named animal with a consistent pronoun set."""
    if rng.random() < 0.55:
        gender = rng.choice(["she", "he"])
        name = rng.choice(_NAMES[gender])
        adj = rng.choice(_ADJ_CHAR)
        intro = f"a {adj} {'girl' if gender == 'she' else 'boy'} named {name}"
        kind = "girl" if gender == "she" else "boy"
    else:
        animal, gender = rng.choice(_ANIMALS)
        name = rng.choice(_NAMES[gender])
        adj = rng.choice(_ADJ_CHAR)
        intro = f"{_article(adj)} {adj} {animal} named {name}"
        kind = animal
    return {"name": name, "intro": intro, "kind": kind, "gender": gender, **_pron(gender)}


def _story(rng: random.Random) -> str:
    hero = _character(rng)
    friend = _character(rng)
    while friend["name"] == hero["name"]:
        friend = _character(rng)
    place_word, place = rng.choice(_PLACES)
    obj, color = rng.choice(_OBJECTS)
    act = rng.choice(_ACTIVITIES)
    good = rng.choice(_FEELINGS_GOOD)
    bad = rng.choice(_FEELINGS_BAD)
    h, f = hero, friend
    s: list[str] = []

    s.append(f"{rng.choice(_OPENINGS)} there was {h['intro']}. {h['Subj']} lived {place}.")
    if rng.random() < 0.6:
        s.append(rng.choice(_WEATHER))
    s.append(rng.choice([
        f"{h['name']} loved to {act} every day.",
        f"{h['Subj']} had {_article(color)} {color} {obj} that {h['subj']} loved very much.",
        f"{h['name']} liked to {act} with {h['pos']} friend {f['name']}, {_article(f['kind'])} {f['kind']}.",
    ]))
    if rng.random() < 0.5:
        s.append(rng.choice([
            f"Every morning, {h['pos']} mom made {h['obj']} a warm breakfast.",
            f"{h['Subj']} had a {rng.choice(_ADJ_CHAR)} little sister who liked to follow {h['obj']} around.",
            f"{h['name']}'s favorite color was {rng.choice(['red', 'blue', 'green', 'yellow', 'purple'])}.",
            f"{h['Subj']} often sang a song about the {rng.choice(['moon', 'sea', 'trees', 'rain', 'stars'])}.",
            f"Near {h['pos']} home there was an old {rng.choice(['tree', 'bridge', 'well', 'fence', 'barn'])}.",
        ]))
    plot = rng.randrange(4)
    if plot == 0:  # lost object, found with help
        s.append(f"One day, {h['name']} could not find {h['pos']} {color} {obj}. {h['Subj']} looked everywhere.")
        s.append(f"{h['name']} felt {bad}. \"Where is my {obj}?\" {h['subj']} asked.")
        s.append(f"Then {f['intro']} came by. \"I will help you look,\" said {f['name']}.")
        spot = rng.choice(["under a big tree", "behind the door", "in the tall grass", "next to the pond",
                           "under the bed", "in a basket"])
        s.append(f"They looked and looked. At last, {f['name']} saw the {obj} {spot}.")
        s.append(f"\"Thank you, {f['name']}!\" said {h['name']}. {h['Subj']} was {good} again.")
    elif plot == 1:  # sharing conflict
        s.append(f"One day, {f['intro']} wanted to play with {h['name']}'s {obj}.")
        s.append(f"\"No, it is mine!\" said {h['name']}. {f['name']} felt {bad} and walked away.")
        s.append(f"{h['name']} sat alone {place}. {h['Subj']} did not feel {good}. {h['Subj']} felt {bad} too.")
        s.append(f"So {h['name']} went to {f['name']} and said, \"I am sorry. Let us play with my {obj} together.\"")
        s.append(f"{f['name']} smiled. They played all day, and both of them were {good}.")
    elif plot == 2:  # a challenge and trying again
        goal = rng.choice(["climb the big hill", "fly the kite high", "swim across the pond", "build a tall tower",
                           "bake a cake", "learn to ride a bike", "catch the ball"])
        tries = rng.randint(2, 4)
        s.append(f"One day, {h['name']} wanted to {goal}. It was hard.")
        fails = [f"{h['Subj']} tried, but {h['subj']} fell down.",
                 f"{h['Subj']} tried again, but it did not work.",
                 f"The first time, {h['subj']} was too {rng.choice(['slow', 'small', 'tired'])}.",
                 f"{h['Subj']} tried very hard, but it was still too difficult.",
                 f"Oh no! Everything went wrong, and {h['subj']} had to start over."]
        for i, line in enumerate(rng.sample(fails, tries - 1)):
            s.append(line)
            if i == 0:
                s.append(f"{h['name']} felt {bad}. \"I can not do it,\" {h['subj']} said.")
        s.append(f"Just then, {f['intro']} came to see {h['obj']}.")
        s.append(f"{f['name']} said, \"Do not give up, {h['name']}. You can do it!\"")
        s.append(f"So {h['name']} tried one more time. This time, {h['subj']} did it!")
        s.append(f"{h['name']} and {f['name']} cheered. {h['name']} was very {good}.")
    else:  # a surprise / helping someone in trouble
        trouble = rng.choice(["was stuck in a tree", "was lost", "had a hurt leg", "could not get home",
                              "was cold and hungry", "had lost a shoe"])
        s.append(f"One day, {h['name']} heard a noise. It was {f['intro']}. {f['Subj']} {trouble}.")
        s.append(f"\"Please help me,\" said {f['name']}. {f['Subj']} was very {bad}.")
        helpitem = rng.choice([obj, "rope", "blanket", "ladder", "map", "snack"])
        s.append(f"{h['name']} thought hard. Then {h['subj']} had an idea. {h['Subj']} used {h['pos']} {helpitem}.")
        s.append(f"Soon {f['name']} was safe. \"Thank you, {h['name']}. You are a good friend,\" said {f['name']}.")
        s.append(f"From that day on, {h['name']} and {f['name']} were best friends.")
    ending = rng.random()
    if ending < 0.4:
        s.append(f"{rng.choice(['The end.', 'And that is the end of the story.'])}")
    elif ending < 0.75:
        s.append(f"{h['name']} learned something that day. {rng.choice(_MORALS)}")
    else:
        s.append(f"That night, {h['name']} went to sleep with a big smile.")
    return " ".join(s)


def iter_stories(seed: int = 0, start: int = 0) -> Iterator[str]:
    """Yield stories ``start, start + 1, ...`` for ``seed`` forever (story i depends only on (seed, i))."""
    i = start
    while True:
        yield _story(random.Random(seed * 1_000_003 + i))
        i += 1


def generate_stories(n_bytes: int, seed: int = 0) -> list[str]:
    """The shortest list of stories (from story 0) whose ``"\\n\\n"``-joined UTF-8 size is >= ``n_bytes``.

    Parameters
    ----------
    n_bytes : int
        Minimum size of the joined text in bytes (> 0).
    seed : int
        Corpus seed; the same ``(n_bytes, seed)`` always gives the same list.

    Returns
    -------
    list of str
        The stories, in order.
    """
    from sv_attention.errors import InvalidInputError

    if not isinstance(n_bytes, int) or n_bytes <= 0:
        raise InvalidInputError(f"n_bytes must be a positive integer, got {n_bytes!r}; pass e.g. 4_000_000.")
    out: list[str] = []
    total = -2
    for story in iter_stories(seed):
        out.append(story)
        total += len(story.encode("utf-8")) + 2
        if total >= n_bytes:
            break
    return out
