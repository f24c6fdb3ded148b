"""Reinforcement learning with forklift rollouts: tasks with exact checkers and a GRPO loop."""
