"""The built-in prompt set of `specdec distill`: what the target is asked, so that the text it
answers with teaches a draft its distribution.

The prompts are built from request templates × subjects (chat questions, how-to, advice,
comparisons, lists, stories, poems, code, emails, facts), because a draft learns the
target's habits from the variety of contexts it sees, not from any one text. Every subject
list is split by position — every HELDOUT_EVERY-th subject is held out — so held-out
prompts differ from the training ones in their subject, not just in wording: held-out
agreement then measures how the draft generalises, as it must on users' prompts.

The prompts of `specdec bench` (specdec.bench.prompts) are in neither split: EXCLUDED holds
one pattern per bench subject, any prompt matching one is dropped, and the tests check that
every bench prompt is covered by a pattern, so the bench always measures unseen prompts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRAIN = "train"
HELDOUT = "heldout"
# Every HELDOUT_EVERY-th subject of each list (counting from the 3rd) goes to held-out.
HELDOUT_EVERY = 9
HELDOUT_OFFSET = 2


@dataclass(frozen=True)
class DistillPrompt:
    text: str
    kind: str  # "explain", "advice", "compare", "list", "story", "poem", "code", "email", "facts", ...
    subject: str  # what the split is keyed on
    split: str  # TRAIN or HELDOUT


# One pattern per subject of a `specdec bench` prompt (specdec.bench.prompts); tests check
# that each bench prompt matches one. Matching is case-insensitive.
EXCLUDED: tuple[str, ...] = (
    r"capital of france", r"\bsleep", r"photosynthesis", r"factorial", r"\bmedian\b|\baverage\b",
    r"\bcustomers?\b.*\borders?\b|highest total order", r"\brobot\b.*\bpaint", r"\bsea\b|\bocean\b",
    r"\bdragon", r"barrier reef|coral", r"\bpaycheck|launch is moved|payment provider", r"car park|parking",
    r"pancake",
)
_EXCLUDED_RE = tuple(re.compile(p, re.IGNORECASE) for p in EXCLUDED)


def excluded(text: str) -> bool:
    """True when the text touches a subject of a `specdec bench` prompt."""
    return any(p.search(text) for p in _EXCLUDED_RE)


CONCEPTS = (
    "black holes", "the water cycle", "plate tectonics", "vaccines", "compound interest", "inflation",
    "the immune system", "gravity", "electric circuits", "the greenhouse effect", "DNA", "evolution by natural "
    "selection", "supply and demand", "the internet", "encryption", "machine learning", "blockchain", "volcanoes",
    "the stock market", "rainbows", "the seasons", "magnets", "the human heart", "antibiotics", "solar panels",
    "nuclear fission", "the Roman Empire", "the printing press", "the Industrial Revolution", "democracy",
    "the scientific method", "batteries", "climate change", "recycling", "the moon's phases", "tides and the moon",
    "how airplanes fly", "wind turbines", "the periodic table", "atoms", "light and colour", "sound waves",
    "earthquakes", "hurricanes", "the nervous system", "digestion", "bacteria and viruses", "taxes",
    "interest rates", "credit scores", "the French Revolution", "the Cold War", "ancient Egypt", "the Renaissance",
    "the Silk Road", "memory in the brain", "habits", "cloud computing", "operating systems", "search engines",
    "GPS", "3D printing", "quantum computers", "electric cars", "the speed of light", "time zones", "calendars",
    "fermentation", "baking bread", "composting", "bees and pollination", "migration of birds", "rainforests",
    "deserts", "glaciers", "the ozone layer", "renewable energy", "money", "banks", "insurance", "supply chains",
    "copyright", "the United Nations", "elections", "the constitution", "human rights", "philosophy", "logic",
    "probability", "statistics", "prime numbers", "fractions", "algebra", "geometry", "calculus", "infinity",
    "the Pythagorean theorem", "music theory", "jazz", "impressionist painting", "photography", "film editing",
    "stage acting", "mythology", "the Olympic Games", "chess strategy", "marathon training", "nutrition",
    "vitamins", "meditation", "stress", "blood pressure", "the placebo effect", "allergies", "dinosaurs",
    "fossils", "the solar system", "Mars", "telescopes", "satellites", "the Big Bang", "exoplanets",
    "artificial intelligence", "computer viruses", "passwords", "open-source software", "version control",
    "databases", "compilers", "the stock exchange", "unemployment", "globalisation", "urbanisation",
    "public transport", "bridges", "skyscrapers", "concrete", "steel", "plastics", "glass making", "paper making",
)
EXPLAIN_TEMPLATES = (
    "Explain {} in simple terms.", "What is {}, and why does it matter?", "How does {} work?",
    "Can you explain {} to a complete beginner?", "Give me a short overview of {}.",
    "What are common misconceptions about {}?", "Why should an ordinary person care about {}?",
    "Teach me the basics of {} in a few paragraphs.",
)

GOALS = (
    "learn to play the guitar", "save money on groceries", "start running", "learn a new language",
    "become a better public speaker", "keep a houseplant alive", "start a vegetable garden", "write a CV",
    "prepare for a job interview", "get better at chess", "learn to cook", "organise my week", "stop procrastinating",
    "make friends in a new city", "learn to code", "read more books", "start a small business", "plan a road trip",
    "pack for a long flight", "train a puppy", "teach a child to ride a bike", "decorate a small flat",
    "reduce my screen time", "learn to draw", "improve my handwriting", "negotiate a salary", "write a novel",
    "start journaling", "learn to swim as an adult", "eat more vegetables", "drink more water", "budget for a holiday",
    "clean my kitchen faster", "fix a leaking tap", "change a bicycle tyre", "paint a room", "take better photos",
    "learn to juggle", "stay focused while studying", "prepare for an exam", "give constructive feedback",
    "manage a team", "run an effective meeting", "write a good email", "deal with a difficult coworker",
    "start investing", "pay off debt", "buy a used car", "rent my first flat", "move house", "host a dinner party",
    "learn to dance", "practise mindfulness", "build a morning routine", "learn to touch type",
    "make a podcast", "start a blog", "grow tomatoes", "bake cookies", "brew good coffee", "make fresh pasta",
    "reduce food waste", "volunteer in my community", "learn first aid", "prepare for a hike", "camp in the woods",
    "learn to knit", "improve my posture", "stretch after exercise", "keep a conversation going",
    "apologise sincerely", "say no politely", "remember people's names", "learn a poem by heart",
    "teach myself maths", "understand my electricity bill", "set up a home network", "back up my photos",
)
ADVICE_TEMPLATES = (
    "How can I {}?", "Give me some practical tips to {}.", "What are the first steps to {}?",
    "I want to {}. Where should I start?", "What mistakes do people make when they try to {}?",
    "Make me a simple plan to {} in a month.",
)

PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("a crocodile", "an alligator"), ("RAM", "storage"),
    ("a democracy", "a republic"), ("stocks", "bonds"), ("speed", "velocity"), ("mass", "weight"),
    ("a comet", "an asteroid"), ("a lake", "a river"), ("tea", "coffee"), ("baking soda", "baking powder"),
    ("Python", "JavaScript"), ("a list", "a tuple in Python"), ("HTTP", "HTTPS"), ("a CPU", "a GPU"),
    ("a simile", "a metaphor"), ("a novel", "a short story"), ("frogs", "toads"), ("butterflies", "moths"),
    ("a hurricane", "a tornado"), ("AC", "DC electricity"), ("an LED", "an incandescent bulb"),
    ("a loan", "a mortgage"), ("debit cards", "credit cards"), ("renting", "buying a home"),
    ("email", "instant messaging"), ("a violin", "a viola"), ("a rabbit", "a hare"), ("a dolphin", "a shark"),
    ("weathering", "erosion"), ("fission", "fusion"), ("an ape", "a monkey"), ("a mountain", "a hill"),
    ("a university", "a college"), ("a psychologist", "a psychiatrist"), ("cardio", "strength training"),
    ("white rice", "brown rice"), ("butter", "margarine"), ("a compiler", "an interpreter"),
    ("machine learning", "traditional programming"), ("a laptop", "a desktop computer"), ("wool", "cotton"),
    ("a poem", "a song"), ("a museum", "a gallery"), ("an essay", "a report"), ("a duck", "a goose"),
    ("a recession", "a depression"), ("the Arctic", "the Antarctic"), ("a planet", "a star"),
)
COMPARE_TEMPLATES = ("What is the difference between {} and {}?", "Compare {} and {}: how are they alike and how "
                                                                    "do they differ?")

THINGS = (
    "famous inventions", "healthy breakfast ideas", "board games for families", "ways to save energy at home",
    "classic novels", "European capitals", "musical instruments", "indoor hobbies", "programming languages",
    "famous scientists", "careers in healthcare", "rainy-day activities for kids", "desert animals",
    "uses for a spreadsheet", "good habits for students", "ways to be kind to neighbours", "spices and their uses",
    "wonders of the ancient world", "tips for a first date", "things to pack for camping", "birds of North America",
    "fruits rich in vitamin C", "ways to reuse glass jars", "questions to ask a landlord", "team-building games",
    "famous bridges", "Olympic sports", "types of clouds", "kitchen tools every cook needs", "types of poetry",
    "famous painters", "ways to learn vocabulary", "traditional dances", "simple stretches for office workers",
    "birthday party themes", "types of cheese", "common logical fallacies", "ways to reduce plastic use",
    "dog breeds for small flats", "mountains over 8000 metres", "easy houseplants", "weekend project ideas",
    "skills every adult should have", "ways to stay warm in winter", "podcast topic ideas", "cheap dinner ideas",
    "signs of burnout", "icebreaker questions", "bread types from around the world", "uses of the number zero",
)
LIST_TEMPLATES = ("List ten {} with one sentence about each.", "Name five {} and explain why each one is "
                                                                "interesting.", "Give me a numbered list of {}.")

CHARACTERS = (
    "a lonely lighthouse keeper", "a clumsy wizard", "a talking cat", "an old clockmaker", "a brave little mouse",
    "a detective who hates rain", "a girl who can hear plants", "a retired astronaut", "a baker in a small village",
    "a shy giant", "a time traveller", "a forgetful king", "a young inventor", "a ghost who wants friends",
    "a grandmother who races cars", "a fox and a crow", "a new teacher", "a stray dog", "two rival chefs",
    "a boy who collects clouds", "a knight afraid of horses", "a librarian with a secret", "an ant colony",
    "a snowman in spring", "a musician who lost her voice", "a farmer and a scarecrow", "a penguin in the desert",
)
EVENTS = (
    "finds a mysterious map", "has to save a festival", "wakes up in a different century", "makes an unlikely friend",
    "wins a contest by accident", "loses something precious", "must keep a promise", "discovers a hidden door",
    "gets stuck in a lift", "receives a letter from the future", "opens a tiny shop", "learns to fly",
    "has one day to fix a mistake", "goes on a long journey", "solves a strange puzzle",
)
STORY_TEMPLATES = ("Write a short story about {} who {}.", "Tell me a bedtime story about {} who {}.",
                   "Write the opening paragraph of a story about {} who {}.")

POEM_SUBJECTS = (
    "autumn leaves", "a city at dawn", "an old tree", "the first snow", "a cup of tea", "friendship", "a train "
    "journey", "the moon", "a thunderstorm", "a garden in spring", "a lost key", "mountains", "a busy market",
    "a cat asleep in the sun", "homesickness", "a candle", "rain on a window", "a bicycle", "summer holidays",
    "the desert wind", "a library", "a grandmother's kitchen", "fireflies", "an empty playground", "the stars",
    "a river", "hope", "Monday mornings", "a lighthouse", "wild horses", "the wind", "a clock", "a bridge",
    "a violin", "an old photograph", "a snail", "coffee", "the northern lights", "a forest path", "bees",
    "a first day at school", "the colour blue", "a storm passing", "winter nights", "a kite", "city lights",
)
POEM_TEMPLATES = ("Write a poem about {}.", "Write a haiku about {}.", "Write a short rhyming poem about {}.",
                  "Write a limerick about {}.")

CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "returns the n-th Fibonacci number", "removes duplicates from a list", "checks whether a string is a "
    "palindrome", "merges two sorted lists", "finds the largest number in a list", "converts Celsius to "
    "Fahrenheit", "sorts a list of dictionaries by a key", "reads a CSV file and prints each row",
    "counts how often each character appears in a string", "flattens a nested list", "validates an email "
    "address", "returns the greatest common divisor of two numbers", "implements binary search",
    "implements bubble sort", "generates a random password", "checks whether two strings are anagrams",
    "converts a number to Roman numerals", "computes the sum of digits of a number", "rotates a list by k places",
    "finds the second largest number in a list", "capitalises the first letter of each word",
    "counts vowels in a string", "checks whether a year is a leap year", "converts a binary string to an integer",
    "finds common elements of two lists", "groups words by their first letter", "implements a simple stack class",
    "implements a queue with two stacks", "transposes a matrix", "computes the running total of a list",
    "splits a list into chunks of size n", "finds the longest word in a sentence",
    "returns the mode of a list of numbers", "parses a date string and prints the weekday",
    "implements a simple linked list", "checks balanced parentheses in a string", "counts lines in a file",
    "computes compound interest", "converts a dictionary to JSON and back", "implements FizzBuzz",
    "shuffles a deck of cards", "simulates rolling two dice", "computes the distance between two points",
    "finds all pairs in a list that sum to a target", "caches the results of a slow function",
    "retries a function call up to three times", "removes punctuation from a string", "builds a word frequency "
    "table from a text", "checks whether a number is a perfect square", "implements merge sort",
)
CODE_LANGUAGES = ("Python", "JavaScript", "Python", "Go", "Python", "Rust", "Java", "Python", "C", "TypeScript")
CODE_TEMPLATES = ("Write a {lang} function that {task}.", "Show me how to write a {lang} function that {task}, "
                                                          "and explain how it works.")
CODE_CONCEPTS = (
    "recursion", "a hash map", "object-oriented programming", "a closure", "a race condition", "big-O notation",
    "a REST API", "unit testing", "a linked list", "a binary tree", "dependency injection", "a deadlock",
    "garbage collection", "a pointer", "an interface", "inheritance", "exceptions", "list comprehensions",
    "async and await", "a regular expression", "a generator", "a decorator in Python", "immutability",
    "a git branch", "a database index", "caching", "a lambda function", "type hints", "a virtual environment",
    "a queue", "dynamic programming", "a graph", "breadth-first search", "a mutex", "a memory leak",
)
CODE_CONCEPT_TEMPLATES = ("Explain what {} is in programming, with a short example.",
                          "When should I use {} in my code? Give an example.")

EMAIL_PURPOSES = (
    "to my manager asking for a day off", "to a landlord about a broken heater", "to a teacher about my child's "
    "homework", "thanking a colleague for their help", "to a client apologising for a delay", "inviting my team to a "
    "lunch", "to a neighbour about a noisy party", "asking a professor for a recommendation letter",
    "declining a job offer politely", "to a shop asking for a refund", "welcoming a new team member",
    "to a friend I have not seen for years", "asking for feedback on a presentation", "to a hotel asking about "
    "accessibility", "reminding a club about the annual fee", "cancelling a subscription", "to a recruiter "
    "following up on an interview", "congratulating a friend on a new job", "asking my bank about a strange "
    "charge", "proposing a new idea to my boss", "to parents about a school trip", "resigning from my job",
    "asking a plumber for a quote", "thanking a host after a visit",
)
EMAIL_TEMPLATES = ("Write an email {}.", "Draft a short, friendly message {}.")

FACT_SUBJECTS = (
    "octopuses", "elephants", "Japan", "the Amazon river", "honey", "the human brain", "owls", "Iceland",
    "the Sahara", "chocolate", "Mount Everest", "the Eiffel Tower", "penguins", "volcanoes on other planets",
    "the Great Wall of China", "bats", "Saturn", "tardigrades", "ancient Rome", "the Moon landing", "spiders",
    "Antarctica", "the piano", "Venice", "kangaroos", "lightning", "the Vikings", "giraffes", "Canada",
    "the Nile", "crows", "diamonds", "the Olympics", "Shakespeare", "trains", "hummingbirds", "New Zealand",
    "the heart", "wolves", "tea", "Mexico", "rubber", "comets", "the violin", "Egypt's pyramids", "ants",
)
FACT_TEMPLATES = ("Tell me some interesting facts about {}.", "What is something surprising about {}?",
                  "Share three fun facts about {} for a school project.")

PRODUCTS = (
    "a reusable water bottle", "noise-cancelling headphones", "a standing desk", "a solar-powered lamp",
    "a smart thermostat", "a hiking backpack", "a cast-iron frying pan", "a wooden chess set", "an electric kettle",
    "a fountain pen", "a yoga mat", "a bamboo toothbrush", "a portable speaker", "a board game about trains",
    "a children's picture book", "a weekly meal-kit service", "a language-learning app", "a travel pillow",
    "a handmade ceramic mug", "an e-reader", "a bicycle helmet", "a herb-growing kit", "wireless earbuds",
)
PRODUCT_TEMPLATES = ("Write a product description for {}.", "Write a short advert for {}.")

OPINIONS = (
    "working from home", "homework for young children", "electric scooters in cities", "four-day working weeks",
    "learning Latin at school", "social media for teenagers", "zoos", "space tourism", "self-driving cars",
    "paper books versus e-books", "uniforms at school", "public libraries", "video games as art",
    "tipping in restaurants", "daylight saving time", "remote learning", "city gardens", "online shopping",
)
OPINION_TEMPLATES = ("What are the pros and cons of {}?", "Write a balanced short essay on {}.",
                     "Give me arguments for and against {}.")


def _split_of(index: int) -> str:
    return HELDOUT if index % HELDOUT_EVERY == HELDOUT_OFFSET else TRAIN


def _templated(kind: str, subjects, templates, per_subject: int) -> list[DistillPrompt]:
    """Each subject with `per_subject` templates, rotating through them so that every
    template is used about equally and neighbouring subjects get different wordings."""
    prompts = []
    for i, subject in enumerate(subjects):
        for j in range(per_subject):
            template = templates[(i + j) % len(templates)]
            args = subject if isinstance(subject, tuple) else (subject,)
            prompts.append(DistillPrompt(template.format(*args), kind, " / ".join(args), _split_of(i)))
    return prompts


def _stories() -> list[DistillPrompt]:
    prompts = []
    for i, character in enumerate(CHARACTERS):
        for j in range(5):
            event = EVENTS[(i * 7 + j * 3) % len(EVENTS)]
            template = STORY_TEMPLATES[(i + j) % len(STORY_TEMPLATES)]
            prompts.append(DistillPrompt(template.format(character, event), "story", character, _split_of(i)))
    return prompts


def _code() -> list[DistillPrompt]:
    prompts = []
    for i, task in enumerate(CODE_TASKS):
        for j in range(3):
            lang = CODE_LANGUAGES[(i + 3 * j) % len(CODE_LANGUAGES)]
            template = CODE_TEMPLATES[(i + j) % len(CODE_TEMPLATES)]
            prompts.append(DistillPrompt(template.format(lang=lang, task=task), "code", task, _split_of(i)))
    return prompts + _templated("code", CODE_CONCEPTS, CODE_CONCEPT_TEMPLATES, 2)


def build_prompts() -> list[DistillPrompt]:
    """Every built-in prompt, in a fixed order, bench subjects dropped, duplicates removed."""
    prompts = (
        _templated("explain", CONCEPTS, EXPLAIN_TEMPLATES, 4)
        + _templated("advice", GOALS, ADVICE_TEMPLATES, 3)
        + _templated("compare", PAIRS, COMPARE_TEMPLATES, 2)
        + _templated("list", THINGS, LIST_TEMPLATES, 2)
        + _stories()
        + _templated("poem", POEM_SUBJECTS, POEM_TEMPLATES, 3)
        + _code()
        + _templated("email", EMAIL_PURPOSES, EMAIL_TEMPLATES, 2)
        + _templated("facts", FACT_SUBJECTS, FACT_TEMPLATES, 2)
        + _templated("product", PRODUCTS, PRODUCT_TEMPLATES, 2)
        + _templated("opinion", OPINIONS, OPINION_TEMPLATES, 3)
    )
    seen: set[str] = set()
    kept = []
    for prompt in prompts:
        if prompt.text in seen or excluded(prompt.text):
            continue
        seen.add(prompt.text)
        kept.append(prompt)
    return kept


def read_prompt_file(path) -> list[str]:
    """A user's prompts (`specdec distill --prompts FILE`): one per line, or with a .jsonl
    suffix one JSON object per line whose "prompt" is a string (for prompts spanning lines).
    Blank lines are skipped; anything else malformed is a ValueError naming the line."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"--prompts {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {path}: not UTF-8 text ({e.reason})") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {path}:{number}: not JSON ({e.msg})") from None
            text = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f'--prompts {path}:{number}: expected an object with a non-empty "prompt" string')
            texts.append(text.strip())
        else:
            texts.append(line.strip())
    if not texts:
        raise ValueError(f"--prompts {path}: no prompts in it")
    return texts


def split(prompts: list[DistillPrompt], name: str) -> list[DistillPrompt]:
    return [p for p in prompts if p.split == name]
