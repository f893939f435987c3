"""Which chat template renders a conversation with tools: the model's own when it renders `tools=`, else the shipped
ChatML tool template (`rlhf_cli/templates/chatml_tools.jinja`, the Hermes `<tool_call>{json}</tool_call>` form).

One choice for the two places that render tools: train-sft's tool transcripts (`data.tokenize.Encoder`) and the
environment runner's episodes (`rollout.environments.Environment`), so a model is fine-tuned in the form it is later
sampled in.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

SHIPPED = "the shipped ChatML tool template (rlhf_cli/templates/chatml_tools.jinja)"
PROBE_TOOL = {"type": "function", "function": {"name": "rlhf_probe_tool", "description": "Probes the template.",
                                               "parameters": {"type": "object", "properties": {}}}}
"""The schema a template is probed with when the conversation brings none (a transcript without a `tools` column)."""


def tool_template() -> str:
    """The shipped ChatML tool template (Hermes form), a Jinja chat template."""
    return resources.files("rlhf_cli").joinpath("templates/chatml_tools.jinja").read_text()


def choose_tool_template(tokenizer: Any, schemas: Sequence[dict[str, Any]] = ()) -> tuple[str | None, str]:
    """The chat template to render a conversation with tools (None: the tokenizer's own) and why, in words: the
    tokenizer's own when it renders `tools=` (the first schema's name, or `PROBE_TOOL`'s, appears in its rendering
    of one user message), else (or when the model has none) the shipped ChatML tool template."""
    if not getattr(tokenizer, "chat_template", None):
        return tool_template(), f"{SHIPPED}: the model has no chat template"
    schemas = list(schemas) or [PROBE_TOOL]
    fn = schemas[0].get("function", schemas[0])
    try:
        own = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=schemas, tokenize=False,
                                            add_generation_prompt=True)
        renders = str(fn.get("name")) in own
    except Exception:  # noqa: BLE001 - a template that rejects tools
        renders = False
    if renders:
        return None, "the model's own chat template (it renders tools=)"
    return tool_template(), f"{SHIPPED}: the model's own chat template does not render tools="
