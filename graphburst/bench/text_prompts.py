"""The real-text workload of ``graphburst bench ngram --model MODEL``: prompts a user would send, by class.

The prompts are plain text files in ``graphburst/bench/prompts/`` (their README says where
they come from), one file per class, prompts separated by a line ``---``. Each is sent as one
user message through the model's own chat template, as ``/v1/chat/completions`` renders it.
The copy classes (a passage or code to edit, a document to quote, a list to continue) are
where prompt lookup should hit; ``open_questions`` is where it should not.
"""

from __future__ import annotations

from pathlib import Path

from ..models.tokenizer import render_user_message

PROMPT_DIR = Path(__file__).with_name("prompts")
SEPARATOR = "---"
#: class -> whether the answer should copy from the prompt
CLASSES = {"edit_code": True, "rewrite_prose": True, "quote_document": True, "continue_list": True,
           "open_questions": False}


def load_prompts(name: str) -> list[str]:
    """The prompts of class ``name`` (ValueError naming it when there is no such class)."""
    if name not in CLASSES:
        raise ValueError(f"prompt class must be one of {', '.join(CLASSES)}, got {name!r}")
    lines = (PROMPT_DIR / f"{name}.txt").read_text(encoding="utf-8").splitlines()
    while lines and lines[0].startswith("#"):  # the file's description
        lines.pop(0)
    prompts, current = [], []
    for line in lines + [SEPARATOR]:
        if line.strip() == SEPARATOR:
            text = "\n".join(current).strip()
            if text:
                prompts.append(text)
            current = []
        else:
            current.append(line)
    return prompts


def text_workload(tokenizer, name: str, batch: int) -> list[list[int]]:
    """``batch`` prompts of class ``name``, rendered, the class's prompts repeated in turn to fill the batch."""
    rendered = [render_user_message(tokenizer, text) for text in load_prompts(name)]
    return [rendered[b % len(rendered)] for b in range(batch)]
