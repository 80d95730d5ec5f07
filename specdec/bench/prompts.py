"""The built-in prompt set of `specdec bench`: four kinds of request, as users send them.

Open kinds (chat Q&A, code, creative writing) give the drafter little to copy; grounded
kinds (summarise, rewrite, extract from a given text) copy spans of the prompt, which is
where prompt-lookup drafting pays. Each prompt is one user chat message.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN_KINDS = ("chat", "code", "creative")
GROUNDED = "grounded"
KINDS = (*OPEN_KINDS, GROUNDED)


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str
    text: str


_REEF = ("The Great Barrier Reef, off the coast of Queensland in Australia, is the world's largest coral reef "
         "system. It is made of over 2,900 individual reefs and 900 islands stretching over 2,300 kilometres. "
         "The reef is home to a huge variety of life, including many endangered species, and it can be seen from "
         "outer space. Warming seas have caused mass coral bleaching, which threatens the reef's future.")
_MEMO = ("From: Dana Whitfield, Facilities\nTo: All staff\nDate: 14 March\n\nThe north car park will be closed "
         "from Monday 18 March to Friday 22 March while the surface is repaved. Staff who normally park there "
         "should use the overflow car park on Elm Street, which will be open from 6:30 am. A shuttle bus will "
         "run every 15 minutes between Elm Street and the main entrance. Cyclists are not affected: the bike "
         "shelters stay open. Questions go to facilities@example.org or extension 4410.")
_LETTER = ("hey team, so the launch is moved to next thursday because the payment provider still hasnt "
           "approved our account, which is annoying. everyone please keep testing the checkout page and log "
           "any bugs you find in the tracker. also the marketing email will go out the same day as the launch, "
           "not before. thanks for all the hard work, we are nearly there.")
_RECIPE = ("Pancakes (serves 4). Whisk 200 g plain flour, 2 teaspoons baking powder, a pinch of salt and "
           "1 tablespoon sugar in a bowl. In a jug beat 2 eggs with 300 ml milk and 25 g melted butter. Pour "
           "the wet mixture into the dry one and stir until just combined. Heat a lightly oiled pan over medium "
           "heat, pour in a ladle of batter and cook for 2 minutes on each side until golden.")
_BUGGY = ("def average(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
          "    return total / len(numbers) + 1\n\n\ndef median(numbers):\n    ordered = sorted(numbers)\n"
          "    middle = len(ordered) // 2\n    return ordered[middle]\n")

PROMPTS: tuple[Prompt, ...] = (
    Prompt("capital", "chat", "What is the capital of France, and why is it famous?"),
    Prompt("sleep", "chat", "Give me some practical tips for sleeping better."),
    Prompt("photosynthesis", "chat", "Explain photosynthesis to a ten-year-old."),
    Prompt("factorial", "code", "Write a Python function that returns the factorial of n, with a docstring."),
    Prompt("fix-bugs", "code", "Fix the bugs in this Python code and show the corrected code:\n\n" + _BUGGY),
    Prompt("sql", "code", "Write an SQL query that lists the ten customers with the highest total order "
                          "value, given tables customers(id, name) and orders(id, customer_id, amount)."),
    Prompt("robot-story", "creative", "Write a short story about a robot who learns to paint."),
    Prompt("sea-poem", "creative", "Write a poem about the sea at night."),
    Prompt("dragon", "creative", "Describe a dragon who is afraid of the dark, as the opening of a children's book."),
    Prompt("summarise-reef", GROUNDED, "Summarise this paragraph in two sentences: " + _REEF),
    Prompt("rewrite-email", GROUNDED, "Rewrite this message so it is clear and professional, keeping every "
                                      "fact:\n\n" + _LETTER),
    Prompt("extract-memo", GROUNDED, "From the memo below, list the dates, places and contact details it "
                                     "mentions.\n\n" + _MEMO),
    Prompt("recipe-steps", GROUNDED, "Rewrite this recipe as a numbered list of steps:\n\n" + _RECIPE),
)

# --quick: one prompt per kind.
QUICK_PROMPTS: tuple[Prompt, ...] = tuple(next(p for p in PROMPTS if p.kind == kind) for kind in KINDS)
