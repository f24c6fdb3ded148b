"""Verifiable tasks: prompts whose answers a program checks exactly (no reward model)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_FIRST_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


@dataclass(frozen=True)
class ArithmeticTask:
    """Small additions and subtractions; the reward is 1 when the first integer of the reply
    is the answer, else 0."""

    name: str = "arithmetic"
    max_operand: int = 20

    def problems(self, count: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            if rng.random() < 0.5:
                question, answer = f"What is {a} + {b}?", a + b
            else:
                a, b = max(a, b), min(a, b)
                question, answer = f"What is {a} - {b}?", a - b
            out.append(Problem(f"{question} Reply with only the number.", str(answer)))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        match = _FIRST_INTEGER.search(completion)
        return 1.0 if match is not None and match.group() == problem.answer else 0.0


TASKS = {"arithmetic": ArithmeticTask}


def get_task(name: str) -> ArithmeticTask:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(sorted(TASKS))}")
    return TASKS[name]()
