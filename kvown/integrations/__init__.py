"""kvown inside other servers. Each integration uses kvown's public API only (``kvown``, ``kvown.rank``)."""
