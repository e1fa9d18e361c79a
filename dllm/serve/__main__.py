"""``python -m dllm.serve MODEL [options]`` = ``dllm serve MODEL [options]``."""

import sys

from dllm.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
