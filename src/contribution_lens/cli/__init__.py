"""The ``contribution-lens`` command: ``demo``, ``faithfulness``, ``sinks``, ``replicate`` and ``circuit``, one
module each.

`main` parses, checks every argument before any model is loaded, locks the output folder and
runs. Standard library only at import, so ``--help`` answers without torch.
"""

from contribution_lens.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
