"""Coverage-guided fuzzing of kvown's untrusted-bytes entry points with atheris (libFuzzer).

Owns: running one target of ``kvown.testing.fuzz_targets`` for N inputs in a child process, reading
libFuzzer's report (inputs, coverage, crashes), and the checked-in corpus (tests/fuzz/corpus/<target>).

    python -m kvown.testing.fuzz TARGET --runs N [--seed S] [--json OUT] [--mutant NAME]
    python -m kvown.testing.fuzz --list
    python -m kvown.testing.fuzz --write-seeds        # (re)write the seed files of every target
    python -m kvown.testing.fuzz TARGET --replay [FILE...] [--lines]   # run inputs once: outcomes,
                                                           # or line coverage per kvown module

Rules:
  1. The fuzzing runs in a child process: libFuzzer ends the process when its run count is reached or
     at the first crash, so the parent is what survives to report. Exit status 0 means the target ran
     ``--runs`` inputs without a crash; 1 means a crash (its input is copied to ``--artifacts``); 2 a
     harness failure.
  2. Only kvown's own Python code is instrumented for coverage (after the heavy libraries are
     imported), so torch and NIXL cost nothing per input. C extensions are exercised but not
     coverage-guided: msgpack's unpacker in particular is C; the field validators behind it are Python.
  3. New inputs the fuzzer finds go to a temporary directory; the checked-in corpus is only read, so a
     run never dirties the checkout. ``--keep-corpus DIR`` keeps them for review.
  4. A mutant (``--mutant``) plants a known bug in the child before fuzzing: the run must then crash.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

CORPUS_ROOT = Path(__file__).resolve().parents[2] / "tests" / "fuzz" / "corpus"
DEFAULT_MAX_LEN = 4096


# ---- parent: run, parse, report ------------------------------------------------------------------


def run_target(target: str, runs: int, *, seed: int = 1, max_len: int = DEFAULT_MAX_LEN, mutant: str = "",
               corpus: Path | None = None, artifacts: Path | None = None, keep_corpus: Path | None = None,
               timeout_s: float = 3600.0, per_input_timeout_s: int = 10) -> dict[str, Any]:
    """Fuzz ``target`` for ``runs`` inputs in a child process and return the report (a JSON-able dict).

    Called: by the CLI and by tests, any thread. The child is killed at ``timeout_s`` (rc -9 in the
    report). After error: the report says so (``crashes``, ``finding``); nothing else changed.
    """
    corpus = corpus if corpus is not None else CORPUS_ROOT / target
    with tempfile.TemporaryDirectory(prefix=f"kvown-fuzz-{target}-") as tmp:
        work = Path(tmp)
        out_corpus = keep_corpus if keep_corpus is not None else work / "new"
        out_corpus.mkdir(parents=True, exist_ok=True)
        libfuzzer = [
            f"-atheris_runs={runs}", f"-seed={seed}", f"-max_len={max_len}", f"-timeout={per_input_timeout_s}",
            "-rss_limit_mb=4096", f"-artifact_prefix={work}/", str(out_corpus),
        ]
        if corpus.is_dir():
            libfuzzer.append(str(corpus))
        cmd = [sys.executable, "-m", "kvown.testing.fuzz", "--child", target, "--mutant", mutant, "--", *libfuzzer]
        path = [str(CORPUS_ROOT.parents[2]), os.environ.get("PYTHONPATH", "")]  # this checkout's kvown first
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
            rc, log = proc.returncode, proc.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired as e:
            rc, log = -9, (e.stdout or b"").decode(errors="replace") + "\n[kvown.testing.fuzz] killed at timeout"
        seconds = time.monotonic() - t0
        report = parse_log(log)
        report.update(target=target, runs_asked=runs, seed=seed, mutant=mutant, rc=rc, seconds=round(seconds, 2),
                      date=datetime.date.today().isoformat(), commit=_commit())
        crash_files = sorted(work.glob("crash-*")) + sorted(work.glob("timeout-*")) + sorted(work.glob("oom-*"))
        report["crashes"] = len(crash_files) or int("finding" in report)
        report["exec_per_s"] = round(report["inputs"] / seconds) if seconds > 0 else None
        report["crash_inputs"] = []
        if crash_files and artifacts is not None:
            artifacts.mkdir(parents=True, exist_ok=True)
            for f in crash_files:
                dst = artifacts / f"{target}-{f.name}"
                shutil.copyfile(f, dst)
                report["crash_inputs"].append(str(dst))
        report["new_corpus_units"] = len(list(out_corpus.iterdir()))
        if rc != 0:
            report["log_tail"] = log[-4000:]
    return report


_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)", re.M)
_DONE = re.compile(r"^Done (\d+) (?:runs )?in (\d+) second", re.M)


def parse_log(log: str) -> dict[str, Any]:
    """Read atheris's output: inputs executed (its ``Done N`` line, or the last status line before a
    crash), the last coverage figures (``cov``: edges of kvown's instrumented code plus libFuzzer's
    own; ``ft``: features), and the Python finding."""
    status = _STATUS.findall(log)
    done = _DONE.findall(log)
    report: dict[str, Any] = {
        "inputs": int(done[-1][0]) if done else int(status[-1][0]) if status else 0,
        "coverage_edges": int(status[-1][1]) if status else None,
        "coverage_features": int(status[-1][2]) if status else None,
    }
    marker = log.find("=== Uncaught Python exception: ===")
    if marker >= 0:
        report["finding"] = log[marker : marker + 3000]
    return report


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=CORPUS_ROOT.parents[2],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=CORPUS_ROOT.parents[2],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- child: atheris -------------------------------------------------------------------------------


def _instrument_kvown() -> int:
    """Rule 2: instrument every already-loaded function of a ``kvown`` module, closures included.

    Why not ``atheris.instrument_imports``: kvown modules are imported before fuzzing starts (the
    targets' fixtures, the mutants), and ``instrument_all`` would also instrument torch (minutes).
    """
    import atheris

    count = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and (getattr(obj, "__module__", None) or "").startswith("kvown"):
            if obj.__module__ in sys.modules and obj.__module__ != __name__:
                atheris.instrument_func(obj)
                count += 1
    return count


def _child(target_name: str, mutant: str, libfuzzer_args: list[str]) -> None:
    import atheris
    import msgpack  # noqa: F401 - loaded before instrumentation (rule 2)

    from kvown.testing import fuzz_targets

    target = fuzz_targets.TARGETS[target_name]
    if mutant:
        fuzz_targets.MUTANTS[mutant][1]()
    try:  # warm-up: the targets import their modules lazily; load them before instrumenting
        target.one_input(b"")
    except Exception:  # noqa: BLE001 - the fuzzer meets this input again and reports it properly
        pass
    n = _instrument_kvown()
    print(f"[kvown.testing.fuzz] target={target_name} mutant={mutant or '-'} instrumented {n} kvown functions",
          flush=True)

    def test_one_input(data: bytes) -> None:
        target.one_input(data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], test_one_input)
    atheris.Fuzz()


# ---- corpus tools -------------------------------------------------------------------------------


def write_seeds(root: Path = CORPUS_ROOT) -> list[Path]:
    """(Re)write every target's seed files: named, small, one valid input of each kind and a few bad."""
    from kvown.testing.fuzz_targets import seeds

    written = []
    for target, files in seeds().items():
        folder = root / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            path = folder / f"seed-{name}"
            path.write_bytes(data)
            written.append(path)
    return written


def replay(target: str, paths: list[Path]) -> list[tuple[str, str]]:
    """Run each input once, in this process, without atheris: ``[(path, outcome)]``; a crash raises."""
    from kvown.testing.fuzz_targets import TARGETS

    one_input = TARGETS[target].one_input
    return [(str(p), one_input(p.read_bytes())) for p in paths]


def line_coverage(target: str, paths: list[Path]) -> dict[str, tuple[int, int]]:
    """Replay ``paths`` under a line tracer: ``{kvown module: (lines run, lines)}`` over the functions
    of that module the corpus entered at all.

    atheris reports edges of all instrumented code together; this says which modules a corpus
    reaches, and how deep it goes inside the functions it reaches (lines of functions it never enters,
    e.g. the cores' local-event handlers, are not counted).
    Called: by ``--replay --lines`` only (tracing is ~10x slower).
    """
    from kvown.testing.fuzz_targets import TARGETS

    one_input = TARGETS[target].one_input
    try:
        one_input(b"")  # load the target's modules before tracing starts
    except Exception:  # noqa: BLE001 - only a warm-up
        pass
    root = str(Path(__file__).resolve().parents[1])
    hit: dict[str, set[int]] = {}

    def tracer(frame: types.FrameType, event: str, _arg: Any) -> Any:
        name = frame.f_code.co_filename
        if not name.startswith(root) or "/testing/" in name:
            return None
        lines = hit.setdefault(name, set())

        def local(frame: types.FrameType, event: str, _arg: Any) -> Any:
            if event == "line":
                lines.add(frame.f_lineno)
            return local

        return local

    sys.settrace(tracer)
    try:
        for p in paths:
            try:
                one_input(p.read_bytes())
            except Exception:  # noqa: BLE001 - coverage of a crashing input still counts
                pass
    finally:
        sys.settrace(None)
    out = {}
    for name, lines in sorted(hit.items()):
        module = compile(Path(name).read_text(), name, "exec")  # module-level lines ran at import: not counted
        run = total = 0
        for body in _function_bodies(module):
            if body & lines:  # only functions the corpus entered: how deep it went where it went
                run, total = run + len(body & lines), total + len(body)
        if total:
            out[str(Path(name).relative_to(Path(root).parent))] = (run, total)
    return out


def _function_bodies(code: types.CodeType) -> list[set[int]]:
    """The body lines of every function nested in ``code`` (``def`` lines and nested bodies apart)."""
    out = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if not const.co_name.startswith("<") and const.co_flags & 0x2:  # CO_NEWLOCALS: a function
                out.append({ln for _, _, ln in const.co_lines() if ln is not None and ln != const.co_firstlineno})
            out += _function_bodies(const)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        sep = argv.index("--")
        _child(argv[1], argv[3] if argv[2] == "--mutant" else "", argv[sep + 1 :])
        return 2  # atheris.Fuzz() never returns
    from kvown.testing.fuzz_targets import MUTANTS, TARGETS

    p = argparse.ArgumentParser(prog="python -m kvown.testing.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", choices=sorted(TARGETS))
    p.add_argument("files", nargs="*", type=Path, help="with --replay: inputs to run once")
    p.add_argument("--runs", type=int, default=10_000, help="inputs to try (default 10000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN)
    p.add_argument("--mutant", default="", choices=["", *sorted(MUTANTS)])
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"), help="crash inputs go here")
    p.add_argument("--keep-corpus", type=Path, help="keep the new inputs the fuzzer found here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--list", action="store_true")
    p.add_argument("--write-seeds", action="store_true")
    p.add_argument("--replay", action="store_true")
    p.add_argument("--lines", action="store_true", help="with --replay: line coverage per kvown module")
    args = p.parse_intermixed_args(argv)
    if args.list:
        for name, t in sorted(TARGETS.items()):
            print(f"{name:18} {t.doc}")
        return 0
    if args.write_seeds:
        print(f"wrote {len(write_seeds())} seed files under {CORPUS_ROOT}")
        return 0
    if args.target is None:
        p.error("name a target (see --list)")
    if args.replay:
        paths = args.files or sorted((CORPUS_ROOT / args.target).iterdir())
        if args.lines:
            for name, (run, total) in line_coverage(args.target, paths).items():
                print(f"{name:40} {run:5}/{total:<5} lines of the functions entered ({100 * run / total:.0f} %)")
            return 0
        for path, outcome in replay(args.target, paths):
            print(f"{outcome:40} {path}")
        return 0
    report = run_target(args.target, args.runs, seed=args.seed, max_len=args.max_len, mutant=args.mutant,
                        artifacts=args.artifacts, keep_corpus=args.keep_corpus, timeout_s=args.timeout_s)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    brief = {k: v for k, v in report.items() if k not in ("log_tail", "finding")}
    print(json.dumps(brief))
    if report.get("finding"):
        print(report["finding"], file=sys.stderr)
    elif report["rc"] != 0:
        print(report.get("log_tail", ""), file=sys.stderr)
    if report["rc"] != 0:
        return 1 if report["crashes"] else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
