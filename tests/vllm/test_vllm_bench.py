"""``kvown bench vllm``'s arithmetic, fast: per-round summaries (errors, token mismatches against the
single instance, tokens/s) and the ratios to NixlConnector; and its place in the bench registry."""

from __future__ import annotations

from kvown.apps import bench
from kvown.apps.benchmarks import vllm as bv


def test_summary_counts_errors_and_mismatches():
    rnd = {"wall_s": 2.0, "results": [
        {"ttft_s": 0.1, "itl_s": 0.01, "ids": [1, 2, 3, 4], "end_s": 0.2},
        {"ttft_s": 0.3, "itl_s": 0.02, "ids": [5, 6, 7, 9], "end_s": 0.5},  # the last token differs
        {"error": "ReadTimeout"},
    ]}
    s = bv.summarize(rnd, [[1, 2, 3, 4], [5, 6, 7, 8], [1]])
    assert s["requests"] == 3 and s["errors"] == 1 and s["token_mismatches"] == 1
    assert s["tokens_per_s"] == 4.0 and s["ttft_ms_p50"] == 200.0


def test_ratios_are_to_nixl_per_concurrency():
    per = {"nixl": {"1": {"ttft_ms_p50": 100.0, "tokens_per_s": 50.0}},
           "kvown": {"1": {"ttft_ms_p50": 105.0, "tokens_per_s": 49.0}}}
    assert bv.ratios(per)["kvown"]["1"] == {"ttft_p50": 1.05, "tokens_per_s": 0.98}
    assert bv.ratios({"single": per["kvown"]}) == {}  # no NixlConnector in the run: no ratios


def test_prompts_are_the_same_for_every_stack_and_differ_per_level():
    assert bv.prompts(8, seed=1) == bv.prompts(8, seed=1) == bv.prompts(32, seed=1)[:8]
    assert bv.prompts(8, seed=1) != bv.prompts(8, seed=4)


def test_registered_in_the_bench_registry(capsys):
    assert bench.REGISTRY["vllm"].module == "kvown.apps.benchmarks.vllm"
    assert bench.main(["vllm", "--dry-run", "--quick"]) == 0
    assert "kvown.apps.benchmarks.vllm" in capsys.readouterr().out
