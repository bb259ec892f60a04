"""Write the continuous-batching target job (issue 20): chat rows sharing one ~100-token system message,
greedy and sampled with different temperatures and top-p, answers that end at the model's end-of-text
token after different lengths (max_new_tokens 128).

    python tools/make_target_job.py job.jsonl [--rows 48]

Every row carries its own settings and `system`, so the file needs only `--chat` to run:
`lmcli generate --chat --input job.jsonl --output out.jsonl --stats`, or `lmcli bench --sections job`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SYSTEM = (
    "You are a careful assistant for a public library's help desk. Answer the visitor's question "
    "directly and truthfully, in plain English, without greetings, apologies or closing remarks. "
    "Keep to the length the question asks for: a word, a sentence or a short paragraph. If a fact is "
    "uncertain, say so in a few words rather than guessing. Never invent titles, authors or dates, and "
    "do not use lists, headings or bold text unless the visitor asks for them."
)

QUESTIONS = (
    "In one word: what colour is the sky on a clear day?",
    "What is the capital of France? Answer with the city only.",
    "In one sentence, what is a library card for?",
    "Name one planet of the solar system.",
    "Explain in two sentences why leaves change colour in autumn.",
    "What is 7 times 8? Answer with the number only.",
    "In a short paragraph, describe how to look for a book in a library catalogue.",
    "Is water wet? Answer yes or no.",
    "Give one sentence about the history of printing.",
    "What does a librarian do? Answer in two sentences.",
    "In one word: the opposite of hot.",
    "Describe in a short paragraph why reading to children matters.",
    "Which animal is known as the king of the jungle?",
    "In one sentence, what is photosynthesis?",
    "Write three sentences about the ocean.",
    "What language is spoken in Brazil? One word.",
)

# (temperature, top_p): greedy rows and sampled ones with different settings, in one job
SETTINGS = ((0, None), (0.7, 0.9), (1.0, None), (0.5, 0.8), (0, None), (0.9, 0.95))


def rows(count: int) -> list[dict]:
    out = []
    for i in range(count):
        temperature, top_p = SETTINGS[i % len(SETTINGS)]
        row: dict = {"id": i + 1, "prompt": QUESTIONS[i % len(QUESTIONS)], "system": SYSTEM,
                     "max_new_tokens": 128, "temperature": temperature}
        if temperature:
            row["seed"] = 1000 + i
            if top_p is not None:
                row["top_p"] = top_p
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--rows", type=int, default=48)
    args = parser.parse_args()
    args.output.write_text("".join(json.dumps(row) + "\n" for row in rows(args.rows)), encoding="utf-8")


if __name__ == "__main__":
    main()
