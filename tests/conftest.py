import os
import sys

# Tests import the package from the checkout and the harness from tests/.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
