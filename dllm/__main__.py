import sys

from dllm.cli import main

sys.exit(main())
