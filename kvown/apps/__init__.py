"""The programs behind the ``kvown`` command: demo, qualify, bench, doctor, inspect, docs generation.

Users of the library, not part of it: they import the public API (``kvown``) and the runtime, and
nothing below ``kvown`` imports them.
"""
