"""Puts tests/distributed on the import path for the launcher shared by both runner families."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
