"""The words: every check outcome and every finding is data (kind + facts); this package writes its sentence.

`text(kind, facts)` looks the kind up in one table (`checks.MESSAGES` for check outcomes, `reports.MESSAGES`
for bench, depth and params findings). An entry is a format string over the facts, or a function of them.
"""

from __future__ import annotations

from tblock_cli.messages import batch, checks, compare, distributed, dtypes, gradients, norms, reports, spec, training

MESSAGES = {**checks.MESSAGES, **batch.MESSAGES, **distributed.MESSAGES, **reports.MESSAGES, **compare.MESSAGES, **spec.MESSAGES, **training.MESSAGES,
            **norms.MESSAGES, **dtypes.MESSAGES, **gradients.MESSAGES}


def text(kind: str, facts: dict) -> str:
    """The sentence for one outcome or finding; an unknown kind is shown with its facts rather than hidden."""
    template = MESSAGES.get(kind)
    if template is None:
        return f"{kind} {facts}" if facts else kind
    return template(facts) if callable(template) else template.format_map(facts)
