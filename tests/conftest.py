import os
import sys

# test helpers (toy_tasks.py) import as top-level modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
