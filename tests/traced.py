"""Run a script with TorchDynamo's traced graphs logged (TORCH_LOGS=graph_code, switched on from
inside): a test tool. TORCH_LOGS in a run's environment is read when torch is imported, so it
would start the run cold instead of forked from the warm zygote (tests/helpers.py).

    python tests/traced.py scripts/train_single.py ARGS...
"""

import runpy
import sys

import torch._logging

torch._logging.set_logs(graph_code=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
