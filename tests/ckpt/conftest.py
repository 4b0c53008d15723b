"""Makes the ckpt test helpers (``ckpt_testlib``) importable from the tests and their children."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
