"""Output conventions every command follows: one JSON format, progress only where a person
watches."""
from __future__ import annotations

import json
import sys
from typing import Any, TextIO


def json_text(obj: Any) -> str:
    """The --json output of every command: indented by 2, keys in the order the report lists them."""
    return json.dumps(obj, indent=2)


def print_json(obj: Any) -> None:
    """Print obj as the commands' --json output."""
    print(json_text(obj))


def progress_wanted(asked: bool, stream: TextIO | None = None) -> bool:
    """Progress is shown when asked for (--progress) or when its stream (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    if asked:
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
