"""Run a training script as if its GPU were one that Inductor compiles for: a test tool, not a feature.

    python tests/probe_ready_gpu.py scripts/train_single.py ARGS...

common.recipe.compiling.why_eager_here answers None, so that --compile auto compiles on this CPU as it
would on such a GPU (Inductor's CPU code, no CUDA graphs); the rest is the script's own, failures
included.
"""

import runpy
import sys

import common.recipe.compiling

common.recipe.compiling.why_eager_here = lambda: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
