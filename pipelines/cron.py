"""Validation of the 6-field cron expressions Kubeflow Pipelines schedules use (seconds first).

KFP parses schedules with robfig/cron in its seconds-first mode: ``SEC MIN HOUR DOM MONTH DOW``, each
field ``*``, ``?`` (day fields), a value, a range ``a-b``, a step ``*/n`` or ``a-b/n``, or a comma list;
months and weekdays also take names (JAN, MON). A 5-field Unix cron line is the common mistake, so it
gets an error that shows the 6-field equivalent.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

FIELDS: List[Tuple[str, int, int]] = [
    ("second", 0, 59), ("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
    ("day of week", 0, 6),
]
_NAMES: Dict[str, Dict[str, int]] = {
    "month": {m: i + 1 for i, m in enumerate("JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split())},
    "day of week": {d: i for i, d in enumerate("SUN MON TUE WED THU FRI SAT".split())},
}
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_PART = re.compile(r"^(?P<range>\*|\?|[A-Za-z0-9]+(?:-[A-Za-z0-9]+)?)(?:/(?P<step>\d+))?$")


class CronError(ValueError):
    """A cron expression KFP would reject; the message says which field and why."""


def _value(text: str, name: str, low: int, high: int, expression: str) -> int:
    names = _NAMES.get(name, {})
    value = names.get(text.upper()) if not text.isdigit() else int(text)
    if value is None or not low <= value <= high:
        raise CronError(f"--cron {expression!r}: {name} value {text!r} is outside {low}-{high}")
    return value


def _check_field(text: str, name: str, low: int, high: int, expression: str) -> None:
    for part in text.split(","):
        match = _PART.match(part)
        if not match:
            raise CronError(f"--cron {expression!r}: {name} field {text!r} is not a cron field")
        span, step = match.group("range"), match.group("step")
        if step is not None and int(step) < 1:
            raise CronError(f"--cron {expression!r}: {name} step must be at least 1")
        if span == "?" and name not in ("day of month", "day of week"):
            raise CronError(f"--cron {expression!r}: '?' is only allowed in the day fields, not {name}")
        if span in ("*", "?"):
            continue
        first, _, last = span.partition("-")
        start = _value(first, name, low, high, expression)
        if last and _value(last, name, low, high, expression) < start:
            raise CronError(f"--cron {expression!r}: {name} range {span!r} runs backwards")


def validate_cron(expression: str) -> str:
    """Returns ``expression`` normalised (single spaces) when KFP accepts it.

    Raises:
        CronError: wrong number of fields (a 5-field line gets a 6-field suggestion) or a bad field.
    """
    text = " ".join(expression.split())
    if text.lower() in _DESCRIPTORS or text.lower().startswith("@every "):
        return text
    fields = text.split(" ") if text else []
    if len(fields) == 5:
        raise CronError(f"--cron {expression!r} has 5 fields; Kubeflow Pipelines needs 6 with seconds first, "
                        f"e.g. '0 {text}'")
    if len(fields) != 6:
        raise CronError(f"--cron {expression!r} has {len(fields)} fields; Kubeflow Pipelines needs 6: "
                        "SECOND MINUTE HOUR DAY-OF-MONTH MONTH DAY-OF-WEEK, e.g. '0 0 3 * * 0'")
    for field_text, (name, low, high) in zip(fields, FIELDS):
        _check_field(field_text, name, low, high, expression)
    return text

