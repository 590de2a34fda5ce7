"""The distillation prompt set, written for this project: topics crossed with task templates.

Chat questions, code tasks, and rewrite tasks that copy from the prompt, like the requests a
chat model serves. It shares no text with bench/prompts, which measures the drafter.
"""
from __future__ import annotations

import random

TOPICS = (
    "volcanoes", "bread baking", "solar panels", "the water cycle", "chess openings", "honey bees",
    "public libraries", "electric bicycles", "coral reefs", "the printing press", "sleep", "composting",
    "black holes", "jazz music", "bridges", "vaccines", "rainforests", "spreadsheets", "the moon landing",
    "coffee roasting", "earthquakes", "recycling plastic", "marathon training", "the human heart",
    "wind turbines", "ancient Rome", "photosynthesis", "password security", "tea ceremonies", "glaciers",
    "3D printing", "bird migration", "the stock market", "origami", "desert plants", "lighthouses",
    "machine learning", "fermentation", "the immune system", "trains", "knitting", "tides",
    "city parks", "satellites", "mushrooms", "the piano", "first aid", "octopuses",
    "renewable energy", "map making", "time zones", "bicycle repair", "museums", "rain gauges",
    "board games", "the Olympic games", "clouds", "electric cars", "beekeeping tools", "friendship",
)

CHAT_TEMPLATES = (
    "Explain {topic} to a ten-year-old.",
    "What are three surprising facts about {topic}?",
    "Give me five practical tips about {topic}.",
    "Write a short story in which {topic} plays a central role.",
    "What are the pros and cons of {topic}? Answer with two short lists.",
    "Write a haiku about {topic}, then explain the imagery in it.",
    "I am writing a school report on {topic}. Suggest an outline with headings.",
    "Answer briefly: why do people care about {topic}?",
)

CODE_TEMPLATES = (
    "Write a Python function that stores facts about {topic} in a dictionary and prints them sorted.",
    "Write a Python class that models {topic}, with a docstring and two methods.",
    "Write a SQL table definition for a database about {topic}, and one query that uses it.",
    "Write a JavaScript function that returns a random fact about {topic} from an array.",
)

REWRITE_TEMPLATES = (
    "Rewrite this note as a polite email: 'meeting about {topic} moved to thursday 3pm, bring the "
    "draft report and the numbers, ask Sam if the room is free'",
    "Summarize in one sentence: 'Our club spent the spring learning about {topic}. Every week a member "
    "presented what they had read, and at the end we wrote a short guide for newcomers.'",
    "Turn these notes into a paragraph: {topic}; interesting history; many open questions; "
    "worth a weekend project.",
    "Fix the grammar: 'me and my friend has been reading about {topic} since last year and we thinks "
    "it are fascinating.'",
)

TEMPLATES = CHAT_TEMPLATES + CODE_TEMPLATES + REWRITE_TEMPLATES
PROMPT_SET_SIZE = len(TOPICS) * len(TEMPLATES)


def distill_prompts(count: int, seed: int) -> list[str]:
    """`count` distinct prompts, a seeded shuffle of topics x templates (at most their product)."""
    every = [template.format(topic=topic) for topic in TOPICS for template in TEMPLATES]
    if count > PROMPT_SET_SIZE:
        raise ValueError(f"--num-prompts {count} exceeds the {PROMPT_SET_SIZE} prompts the set holds")
    random.Random(seed).shuffle(every)
    return every[:count]
