"""`forklift bench spec`'s two workloads. Input-grounded: the answer copies much of the prompt
(correct a passage, quote a document, edit code), where drafts looked up in the prompt are
often right. Open chat: answers made up fresh, where they rarely are."""

from __future__ import annotations

from forklift.bench.workload import INSTRUCTIONS

_STORY = (
    "Maria opened the bakery at six every morning. She baked bread, rolls and a few cakes, "
    "and by seven the first customers were waiting at the door. Her brother Tomas delivered "
    "the bread to three cafes in the old town, and he always came back with empty baskets."
)
_REPORT = (
    "Quarterly report. Revenue grew by 12 percent to 4.2 million euros, driven by the new "
    "online shop. Costs rose by 5 percent, mostly for shipping. The team hired four people "
    "in support and two in engineering. The board approved a budget of 300,000 euros for a "
    "second warehouse in Lyon, which should open in March."
)
_CODE = """def total_price(items):
    total = 0
    for item in items:
        if item["quantity"] > 0:
            total = total + item["price"] * item["quantity"]
    return total


def average_price(items):
    count = 0
    total = 0
    for item in items:
        count = count + 1
        total = total + item["price"]
    return total / count
"""
_RECIPE = (
    "Tomato soup. Chop two onions and three cloves of garlic. Fry them in olive oil for five "
    "minutes. Add one kilogram of tomatoes, half a litre of water and a spoon of salt. Cook "
    "for twenty minutes, then blend until smooth and serve with fresh basil."
)
_EMAIL = (
    "Hi team, the meeting on Thursday is moved to Friday at ten. Please bring the sales "
    "figures for May and the list of open support tickets. Lunch will be provided after the "
    "meeting. Thanks, Anna"
)

INPUT_GROUNDED = (
    f"Fix the spelling mistakes in this text and write it out in full:\n\n"
    f"{_STORY.replace('morning', 'mornin').replace('customers', 'custmers')}",
    f"Repeat the following text exactly, word for word:\n\n{_REPORT}",
    f"Rename the variable `total` to `running_sum` in this code and show the whole code:\n\n"
    f"{_CODE}",
    f"Rewrite this recipe as a numbered list of steps, keeping the wording:\n\n{_RECIPE}",
    f"Here is an email:\n\n{_EMAIL}\n\nCopy the email, changing Friday to Monday.",
    f"Document:\n{_REPORT}\n\nQuote the sentences of the document that mention money.",
    f"Add a docstring to each function and show the whole code:\n\n{_CODE}",
    f"Document:\n{_STORY}\n\nWhat did Tomas do? Answer by quoting the document.",
    f"Translate nothing; just repeat this email exactly:\n\n{_EMAIL}",
    f"Correct the grammar of this text and write it out in full:\n\n"
    f"{_RECIPE.replace('Chop', 'Chops').replace('serve', 'serves')}",
    f"Convert this function to use a list comprehension where it can, showing all code:\n\n{_CODE}",
    f"Document:\n{_RECIPE}\n\nList every ingredient with its amount, as written in the document.",
)

OPEN_CHAT = INSTRUCTIONS[:16]

WORKLOADS = {"input-grounded": INPUT_GROUNDED, "open-chat": OPEN_CHAT}
