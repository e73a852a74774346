"""A scripted policy for `tests.support.fake_llm` (benches, api and e2e tests): valid actions, instantly.

    python -m tests.support.fake_llm --port 9100 --responder tests.support.fake_policy:respond

s3: every step marks documents 1 and 2 of the newest block and searches a new query derived from the
question, until the environment says the last search is done; then it marks and stops. QAgent: plans
and searches two queries per round until its last round, then answers. The queries are deterministic,
so a run can be checked against what a retriever returns for them.
"""

from __future__ import annotations

import json
from typing import Any


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body.get("messages", []) if isinstance(m, dict)]


def _question(messages: list[dict[str, Any]]) -> str:
    for message in messages:
        content = str(message.get("content", ""))
        if message.get("role") == "user" and "<question>" in content:
            return content.split("<question>", 1)[1].split("</question>", 1)[0].strip()
    return ""


def s3_step(messages: list[dict[str, Any]]) -> str:
    step = sum(1 for m in messages if m.get("role") == "assistant")
    last = str(messages[-1].get("content", "")) if messages else ""
    selection = "<important_info>[1, 2]</important_info>\n"
    if "This was the last search" in last:
        return selection + "<search_complete>True</search_complete>"
    query = json.dumps({"query": f"{_question(messages)} (aspect {step + 1})"})
    return f"{selection}<search_complete>False</search_complete>\n<query>{query}</query>"


def qagent_step(messages: list[dict[str, Any]]) -> str:
    step = sum(1 for m in messages if m.get("role") == "assistant")
    system = str(messages[0].get("content", "")) if messages else ""
    rounds = 3
    marker = "at most "
    if marker in system:
        try:
            rounds = int(system.split(marker, 1)[1].split()[0])
        except ValueError:
            rounds = 3
    question = _question(messages)
    reflection = "" if step == 0 else "<reflection>found part of it</reflection>\n"
    if step >= rounds - 1 and step > 0:
        return reflection + "<answer>done</answer>"
    queries = "".join(f"<query>{question} (part {step + 1}.{i})</query>" for i in (1, 2))
    return f"{reflection}<plan>look up the missing parts</plan>\n<search>{queries}</search>"


def respond(body: dict[str, Any]) -> str:
    """fake_llm responder: s3 or QAgent, recognised from the system prompt."""
    messages = _messages(body)
    system = str(messages[0].get("content", "")) if messages else ""
    if "search copilot" in system:
        return s3_step(messages)
    if "search agent" in system:
        return qagent_step(messages)
    return ""
