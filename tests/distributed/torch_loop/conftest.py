"""Puts tests/distributed/common (the torchrun launcher) on the import path.

Not tests/distributed itself: its ``mmengine`` folder would then import as a namespace package in an env
without MMEngine.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
