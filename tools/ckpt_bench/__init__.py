"""The checkpoint benchmark, split by concern; ``tools/bench_ckpt.py`` is the entry point.

* ``common.py``: constants, logging, peak RSS, page-cache control, small helpers.
* ``phases.py``: the paddle-side phases (raw I/O limits, engine save/load, all-gather + paddle.save, changed world).
* ``torch_dcp.py``: PyTorch DCP on the same state (a separate job).
* ``report.py``: the markdown table and the JSON file.
"""

import warnings

# paddle warns about a missing ccache at import; the benchmark's output is a report, keep it clean
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
