"""Verifiable tasks: prompts whose answers a program checks exactly (no reward model)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


@dataclass(frozen=True)
class ArithmeticTask:
    """Sums of two one-digit numbers. The reward is 1 when the last integer of the reply
    is the sum, else 0: replies are cut at a few tokens, so the policy must learn to reach
    the answer quickly (the default model starts verbose, at about 20% at temperature 1)."""

    name: str = "arithmetic"
    max_operand: int = 9

    def problems(self, count: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            out.append(Problem(f"What is {a} + {b}?", str(a + b)))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        numbers = _INTEGER.findall(completion)
        return 1.0 if numbers and numbers[-1] == problem.answer else 0.0


TASKS = {"arithmetic": ArithmeticTask}


def get_task(name: str) -> ArithmeticTask:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(sorted(TASKS))}")
    return TASKS[name]()
