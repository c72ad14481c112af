"""A held-out domain split of free-form requests, written by hand: `domain.freeform`.

The domain train/dev/bench questions are made through templates: the corpus's ("Fix the bug in this
function:\\n{code}", "Which {cmd} option does this: ...", fortune cookies as chat) and the phrasings of the requests
about each domain (`asks.py`), so even their held-out parts follow a pattern someone wrote. These requests are
phrased the way a user would type them, none starts like a training template (`template_hits` checks; the tests
hold every request to it), and none is used for training or checkpoint selection: it is a test split only,
reported beside `domain.bench`.
"""

from __future__ import annotations

import re
from typing import Sequence

from .data import Candidate, Question

FREEFORM: dict[str, tuple[str, ...]] = {
    "chat": (
        "Hey, how was your weekend? Mine was way too short.",
        "Tell me a joke about cats.",
        "I'm bored, can we just talk for a bit?",
        "What's your favourite season and why?",
        "Good morning! Any tips for staying cheerful on a rainy Monday?",
        "I just got back from a trip to Lisbon and I loved the food there.",
        "Do you think pineapple belongs on pizza?",
        "Can you cheer me up? I had a rough day at work.",
        "What would you name a pet goldfish?",
        "Tell me something funny that happened to you.",
        "Thanks for the help earlier, you're great.",
        "If you could travel anywhere, where would you go?",
        "My sister is getting married next month and I'm nervous about my speech.",
        "Recommend a good book for a long train ride.",
        "Knock knock.",
        "How do you feel about Mondays?",
    ),
    "agent": (
        "Find every file over 100 MB in my home directory and delete the ones older than a year.",
        "Check which process is listening on port 8080 and kill it.",
        "Clone the repository, run the test suite and tell me which tests fail.",
        "Back up /etc to a tarball, copy it to the backup server over ssh, then verify the checksum.",
        "My disk is almost full; figure out what is using the space and clean up the apt cache.",
        "Rename all the .jpeg files in this folder to .jpg.",
        "Download the latest release tarball, unpack it and build it with make.",
        "Add a cron job that rotates the nginx logs every night at 2am.",
        "Search the system logs for errors from the last hour and summarize them.",
        "Create a new user called deploy, add it to the docker group and copy my ssh key to it.",
        "Count how many lines are in the files of each subdirectory of this project.",
        "Restart the postgres service and show me its status afterwards.",
        "Compress every log file older than a week in /var/log/myapp.",
        "Look up the IP address of example.org and ping it three times.",
        "Upgrade all the packages on this server and reboot if the kernel changed.",
        "Go through my git branches and delete the ones already merged into main.",
    ),
    "coding": (
        "Can you write a function that reverses a linked list in Python?",
        "My Python script throws KeyError when the dictionary is missing a key; how should I handle that?",
        "What's the difference between a list and a tuple in Python?",
        "Refactor this loop into a list comprehension: result = []; for x in data: if x > 0: result.append(x * 2)",
        "Why is my recursive fibonacci so slow and how do I speed it up?",
        "How can I read a CSV file and compute the average of one column with pandas?",
        "Explain Python decorators with a small example.",
        "I get 'IndentationError: unexpected indent' when I run my script. What does it mean?",
        "Sort a list of dictionaries by their 'age' key.",
        "Write me a class for a bank account with deposit and withdraw methods.",
        "How do generators differ from regular functions?",
        "Parse a date string like 2024-03-15 into a datetime object.",
        "What does if __name__ == '__main__': do at the bottom of a module?",
        "Turn my requests-based downloader into an asyncio version that fetches several URLs at once.",
        "My for loop skips every other element when I remove items from the list inside it. Why?",
        "Code a binary search over a sorted list that returns the index or -1.",
    ),
    "design": (
        "Make a responsive navigation bar that collapses into a hamburger menu on phones.",
        "Which colour palette would suit a calm meditation app?",
        "Center a div both horizontally and vertically on the page.",
        "Draw a simple SVG icon of a house.",
        "My buttons look flat and boring; how can I give them a nicer hover effect?",
        "Design a login form with a username field, a password field and a submit button.",
        "I want a two-column layout that stacks on small screens.",
        "Pick a font pairing for a portfolio website.",
        "Create a card component with an image, a title and a short caption.",
        "The text on my landing page is hard to read over the background photo. What should I change?",
        "Add a dark mode toggle to my web page.",
        "Make an SVG loading spinner that rotates forever.",
        "How should I space the controls on a settings screen so it feels less cluttered?",
        "Style a table so that every other row has a light grey background.",
        "Sketch the layout of a pricing page with three plans side by side.",
        "What's a good way to show form validation errors to users?",
    ),
}


def freeform_questions(candidates: Sequence[Candidate]) -> list[Question]:
    """The hand-written requests as routing questions over `candidates` (the domain data's adapter set)."""
    candidates = tuple(candidates)
    names = {c.name for c in candidates}
    return [Question(text, candidates, label, f"freeform:{label}", f"freeform:{label}:{i}")
            for label, texts in FREEFORM.items() if label in names for i, text in enumerate(texts)]


def template_hits(text: str, templates: Sequence[str]) -> list[str]:
    """The templates (`builders.training_templates()`) that `text` follows: its whole pattern matches, or `text`
    starts with its fixed opening (the part before the first field). Only fixed text of two words or more counts
    ("{Desc}." or "{code}" say nothing)."""
    hits = []
    for template in templates:
        parts = re.split(r"\{\w+\}", template)
        pattern = "^" + "(.+)".join(re.escape(p) for p in parts) + "$"
        opening = parts[0].strip()
        whole = len("".join(parts).split()) >= 2 and re.match(pattern, text, re.DOTALL)
        if whole or (len(opening.split()) >= 2 and text.startswith(opening)):
            hits.append(template)
    return hits
