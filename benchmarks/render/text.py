"""Small Markdown pieces every page uses: the machine line, sentences from free-text notes, tables."""
from __future__ import annotations


def machine_line(machine: dict) -> str:
    parts = [machine.get("gpu") or machine.get("cpu", "unknown CPU")]
    cores = machine.get("cpu_count") or machine.get("cores_visible")
    if cores:
        parts.append(f"{cores} cores visible")
    if machine.get("cpu_flags"):  # the flags that decide bf16/int8 speed (recorded in newer results)
        parts.append("flags " + " ".join(machine["cpu_flags"]))
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)



def sentence(text: str) -> str:
    text = text.strip()
    return (text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")) if text else ""



def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
