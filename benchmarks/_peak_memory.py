"""Run ``contribution-lens ARGS...`` in this process and write its peak CUDA memory to ``$CL_PEAK_FILE``.

``torch.cuda.max_memory_allocated`` of this process (rank 0 under torchrun), in bytes; used by
`gpu_recipe.py`, which cannot read a child process's CUDA statistics.
"""

import os
import sys

import torch

from contribution_lens.cli.app import main

if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    finally:
        target = os.environ.get("CL_PEAK_FILE")
        if target and os.environ.get("LOCAL_RANK", "0") == "0" and torch.cuda.is_available():
            with open(target, "w", encoding="utf-8") as out:
                out.write(str(torch.cuda.max_memory_allocated()))
    sys.exit(code)
