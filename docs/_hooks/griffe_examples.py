"""Griffe extension: a docstring's ``Example:`` section is read as Google style's ``Examples:``.

The package's docstrings end with one runnable ``Example:`` (singular, as the style guide asks);
Griffe reads only the plural as an examples section and would render the doctest lines as Markdown
(``>>>`` as nested quotes, ``x[0][:3]`` as a link). This renames the heading before Griffe parses it.
"""

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
