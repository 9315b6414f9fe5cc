"""The built-in prompt set that speculators are trained on: a few hundred varied chat prompts (questions,
explanations, how-tos, writing, code, lists, summaries of short texts), made by combining task templates
with subjects, in a fixed order so every run trains on the same set. A user's own set (`--prompts FILE`, one
prompt per line) replaces it."""
from __future__ import annotations

from pathlib import Path

__all__ = ["builtin_prompts", "read_prompts"]

_SUBJECTS = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle",
    "machine learning", "the immune system", "volcanoes", "the Roman Empire", "climate change", "DNA",
    "the stock market", "electric cars", "the internet", "vaccines", "the Moon landing", "coffee",
    "honey bees", "the printing press", "earthquakes", "renewable energy", "the human heart", "jazz music",
    "the Great Wall of China", "recycling", "sleep", "chess", "the Olympic Games", "rainbows", "bread baking",
)
_TEMPLATES = (
    "Explain {s} to a ten-year-old.",
    "Give me three interesting facts about {s}.",
    "Write a short paragraph about {s}.",
    "What are the main advantages and disadvantages of {s}?",
    "Summarise what everyone should know about {s} in five bullet points.",
    "Write a haiku about {s}.",
    "What is a common misconception about {s}?",
    "Describe the history of {s} briefly.",
    "Write two quiz questions about {s}, with answers.",
    "How would you teach {s} in a one-hour class?",
)
_CODE = (
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a SQL query that counts the orders per customer.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python function that merges two sorted lists.",
    "Write a JavaScript function that debounces another function.",
    "Explain the difference between a process and a thread.",
    "Write a Python class for a simple bank account.",
    "Write a bash command that counts the lines of every .py file in a folder.",
    "Write a Python function that parses a date string like 2024-03-01.",
    "Explain what a hash map is and when to use one.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a regular expression that matches an email address, and explain it.",
    "Explain recursion with a short Python example.",
    "Write a Python function that computes the average of a list of numbers.",
    "Explain what an HTTP status code 404 means.",
    "Write a unit test in pytest for a function add(a, b).",
    "Explain the difference between git merge and git rebase.",
    "Write a Python function that counts the words in a text.",
)
_ASKS = (
    "Write a polite email asking my manager for a day off next Friday.",
    "Give me a simple recipe for pancakes.",
    "Plan a three-day trip to Rome.",
    "Suggest five names for a small bakery.",
    "How do I improve my focus while studying?",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a weekend hiking trip?",
    "Give me tips for a job interview.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a thank-you note to a teacher.",
    "How can I save money on groceries?",
    "Suggest a weekly workout plan for a beginner.",
    "Write a limerick about a cat.",
    "What are good habits for a healthy morning routine?",
    "Describe a sunset over the sea in three sentences.",
)


def builtin_prompts() -> list[str]:
    """The built-in set: every template with every subject, then code and everyday requests (335 prompts),
    interleaved so that any prefix of the list is varied too."""
    topical = [t.format(s=s) for s in _SUBJECTS for t in _TEMPLATES]
    rest = list(_CODE) + list(_ASKS)
    out, step = [], max(1, len(topical) // len(rest))
    for i, prompt in enumerate(topical):
        out.append(prompt)
        if i % step == step - 1 and rest:
            out.append(rest.pop(0))
    return out + rest


def read_prompts(path: Path | str) -> list[str]:
    """One prompt per non-empty line of a UTF-8 text file (`\\n` inside a line stands for a newline)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line.replace("\\n", "\n").strip() for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one per line)")
    return prompts
