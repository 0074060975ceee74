"""Shared stacks for the serve tests: one disaggregated stack (etcd, prefill, decode, router) and one
single-process server with the same model and seed, started once per session and always stopped."""

from __future__ import annotations

import pytest
from servekit import need_etcd

from kvown.apps.serve.local import LocalStack

# --link-pace-ms: the prefill's link sleeps 2 ms between DATA frames (4 blocks each), so a transfer
# takes long enough for disconnects to land in the middle of it.
SERVER_ARGS = ["--num-blocks", "768", "--max-prompt-tokens", "512", "--link-pace-ms", "2"]


@pytest.fixture(scope="session")
def single_stack(tmp_path_factory):
    with LocalStack(single=True, server_args=SERVER_ARGS, log_dir=tmp_path_factory.mktemp("single")) as stack:
        yield stack


@pytest.fixture(scope="session")
def disagg_stack(tmp_path_factory):
    need_etcd()
    with LocalStack(server_args=SERVER_ARGS, log_dir=tmp_path_factory.mktemp("disagg")) as stack:
        yield stack
