"""kvown inside other inference servers. One subpackage per host server (``vllm``); each is imported
only by that server's processes (they need the host's own venv), never by the rest of kvown, and each
uses kvown's public API only (``kvown``, ``kvown.rank``)."""
