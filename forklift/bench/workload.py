"""The "offline-mixed" workload: real chat instructions with cycling output lengths."""

from __future__ import annotations

INSTRUCTIONS = (
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What are three tips for staying focused while studying?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a colleague who helped me move.",
    "Explain what a hash table is to a beginner programmer.",
    "List five animals that live in the Arctic.",
    "Why do we have seasons on Earth?",
    "Suggest a name for a coffee shop run by cats.",
    "How does a bicycle stay upright when it moves?",
    "Write a limerick about a forgetful wizard.",
    "What are the main causes of inflation?",
    "Describe the water cycle for a ten-year-old.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion with a simple example.",
    "Write an opening line for a mystery novel.",
    "What is photosynthesis and why does it matter?",
    "Give three arguments for learning a second language.",
    "How can I make my houseplants healthier?",
    "Explain the rules of chess in a few sentences.",
    "Write a product description for a reusable water bottle.",
    "What is the capital of Australia, and why was it chosen?",
    "Compare trains and planes for a 500 km trip.",
    "Describe how to brew a good cup of tea.",
    "What are black holes made of?",
    "Write a motivational message for someone starting a new job.",
    "How does compound interest work?",
    "Plan a three-day itinerary for a first visit to Rome.",
)

DEFAULT_OUTPUT_LENGTHS = (32, 64, 128, 512)


def offline_mixed(
    num_requests: int, output_lengths: tuple[int, ...] = DEFAULT_OUTPUT_LENGTHS
) -> list[tuple[str, int]]:
    """(instruction, output length) pairs in arrival order; both lists cycle."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not output_lengths or min(output_lengths) < 1:
        raise ValueError(f"output lengths must be positive, got {output_lengths}")
    return [
        (INSTRUCTIONS[i % len(INSTRUCTIONS)], output_lengths[i % len(output_lengths)])
        for i in range(num_requests)
    ]
