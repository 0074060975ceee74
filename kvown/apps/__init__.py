"""The programs behind the ``kvown`` command: demo, qualify, bench, doctor, inspect, docs generation,
serve (the reference disaggregated server, in ``serve/``).

Users of the library, not part of it: they import the public API (``kvown``) and the runtime, and
nothing below ``kvown`` imports them.
"""
