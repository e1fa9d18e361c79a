"""``python -m dllm.train``: train a tiny bundled model (see :mod:`dllm.train`)."""

import sys

from dllm.train import main

sys.exit(main())
