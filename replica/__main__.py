"""`python -m replica --model tiny --port 8100`."""
import sys

from replica.cli import main

sys.exit(main())
