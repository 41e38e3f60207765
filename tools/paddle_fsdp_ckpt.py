#!/usr/bin/env python3
"""Run ``paddle-fsdp-ckpt`` from a checkout: ``python tools/paddle_fsdp_ckpt.py {inspect,verify,to-hf,from-hf,diff} ...``.

The same tool as the installed console script and ``python -m paddle.distributed.fsdp.tools``; the fork must be
installed (``pip install -e .`` from the checkout) so that ``paddle.distributed.fsdp`` is the fork.
"""

import sys
import warnings

# stock paddle warns at import time when ccache is missing; irrelevant to this tool's output
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

try:
    from paddle.distributed.fsdp.tools.cli import main
except ImportError as e:  # paddle missing, or stock paddle without the fork's overlay
    print(
        f"paddle_fsdp_ckpt.py: error: cannot import the FSDP fork's tools ({e}); install the fork first: "
        f'pip install -e ".[cpu]" from the repository root',
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
