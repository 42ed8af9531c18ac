"""Mutation testing, one source file at a time, against that file's own tests.

    python tools/mutation.py block_manager            # run (resumes where it stopped)
    python tools/mutation.py block_manager --report   # counts and survivors only
    python tools/mutation.py decode_graphs --wall-clock 4  # rerun its timeouts, 4x the clean wall time
    python tools/mutation.py --list

mutmut 3 reads one test selection for every file and ties each mutant to the tests that
executed its function, so with the whole list in pyproject.toml a block-manager mutant also
runs every engine test that allocates a block (minutes per survivor). This script copies the
tracked tree to build/mutation/NAME/, narrows [tool.mutmut] there to one file and the tests
listed for it below, and runs mutmut in that copy; its results stay there between runs.
docs/mutation.md records the counts and argues each equivalent survivor.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (source file, its tests: files or pytest node ids)
TARGETS: dict[str, tuple[str, list[str]]] = {
    "sampler": (
        "fastdeploy/model_executor/layers/sampler.py",
        ["tests/layers/test_sampler.py", "tests/layers/test_device_sampler.py"],
    ),
    "device_sampler": (
        "fastdeploy/model_executor/layers/device_sampler.py",
        ["tests/layers/test_device_sampler.py", "tests/layers/test_sampler.py"],
    ),
    "decode_graphs": (  # the no-host-sync guard through the Triton interpreter (100 s) left out
        "fastdeploy/worker/decode_graphs.py",
        [
            f"tests/engine/test_decode_buckets.py::{t}"
            for t in (
                "test_padding_changes_no_token_logprob_count_or_block",
                "test_padding_rows_run_as_the_bucket_and_write_the_null_block",
                "test_one_padded_step_gives_the_same_logits",
                "test_bucket_settings",
                "test_the_guard_refuses_data_dependent_shapes",
                "test_decode_steps_never_sync_the_host[eager]",
                "test_decode_steps_never_sync_the_host[captured-reference]",
                "test_decode_steps_never_sync_the_host[captured-flashmla-bf16]",
                "test_a_seed_draws_the_same_tokens_alone_or_in_a_batch",
                "test_capture_settings",
                "test_one_copy_fills_the_step_buffer",
                "test_rows_reaching_a_max_model_len_off_the_block_grid_stay_captured",
                "test_each_bucket_is_logged_with_what_capture_did",
            )
        ],
    ),
    "speculation": (
        "fastdeploy/worker/speculation.py",
        ["tests/engine/test_spec_decode.py", "tests/models/test_deepseek_mtp.py"],
    ),
    "grammar": (
        "fastdeploy/input/grammar.py",
        ["tests/input/test_grammar.py", "tests/engine/test_structured_llm.py"],
    ),
    "watchdog": ("fastdeploy/distributed/watchdog.py", ["tests/distributed/test_watchdog.py"]),
    "scheduler": (
        "fastdeploy/scheduler/scheduler.py",
        ["tests/scheduler/test_scheduler.py", "tests/engine/test_swa_cache.py"],
    ),
    "block_manager": (
        "fastdeploy/cache_manager/block_manager.py",
        ["tests/cache_manager/test_block_manager.py", "tests/engine/test_swa_cache.py"],
    ),
}


def _scratch(name: str, timeout_multiplier: float | None = None) -> Path:
    """A copy of the tracked tree whose [tool.mutmut] names one file and its tests (and, if
    given, another timeout multiplier: a loaded machine makes slow tests look like hangs)."""
    source, tests = TARGETS[name]
    work = ROOT / "build" / "mutation" / name
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for rel in files.split():
        dst = work / rel
        if (ROOT / rel).is_file() and rel != "pyproject.toml":
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst)
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^\[tool\.mutmut\]\n(?:(?!^\[).*\n?)*", text, flags=re.M)
    assert block, "pyproject.toml has no [tool.mutmut] table"
    narrowed = re.sub(r"only_mutate = \[.*?\]", f"only_mutate = {json.dumps([source])}", block.group(0), flags=re.S)
    narrowed = re.sub(
        r"pytest_add_cli_args_test_selection = \[.*?\]",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        narrowed,
        flags=re.S,
    )
    if timeout_multiplier is not None:
        narrowed = re.sub(r"timeout_multiplier = [0-9.]+", f"timeout_multiplier = {timeout_multiplier}", narrowed)
    (work / "pyproject.toml").write_text(text.replace(block.group(0), narrowed))
    # mutmut re-collects which tests run which function only for new test names; a changed test
    # body keeps its old association, so collect afresh every run (the results are kept)
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    return work


def report(name: str) -> dict[str, int]:
    """Counts per status for NAME's last run, and the surviving mutants' names on stdout."""
    from mutmut.stats import status_by_exit_code  # a dev-only dependency, imported when used

    source, _ = TARGETS[name]
    meta = ROOT / "build" / "mutation" / name / "mutants" / (source + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    status = {key: status_by_exit_code[code] for key, code in codes.items()}
    counts = Counter(status.values())
    print(f"{name}: {len(codes)} mutants, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for key in sorted(status):
        if status[key] not in ("killed", "not checked"):
            print(f"  {status[key]}: {key}")
    return dict(counts)


def _tests_for(work: Path, tests: list[str], mutant: str) -> list[str]:
    """The tests mutmut's stats tie to ``mutant``'s function, fastest first (so a failing one
    stops the run early); NAME's whole selection where there are no stats."""
    stats = work / "mutants" / "mutmut-stats.json"
    if not stats.exists():
        return tests
    data = json.loads(stats.read_text())
    function = mutant.rsplit("__mutmut_", 1)[0]
    chosen = data["tests_by_mangled_function_name"].get(function)
    return sorted(chosen, key=lambda t: data["duration_by_test"].get(t, 0.0)) if chosen else tests


def _run_tests(work: Path, tests: list[str], mutant: str, limit: float | None) -> tuple[str, float]:
    """NAME's tests in its mutants/ tree with ``mutant`` active ("" for none), in a session of
    their own so a hang is killed whole: ("passed" | "failed" | "hang", wall seconds)."""
    env = dict(os.environ)
    env.pop("MUTANT_UNDER_TEST", None)
    if mutant:
        env["MUTANT_UNDER_TEST"] = mutant
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work / "mutants", env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "hang", time.monotonic() - started
    return ("passed" if rc == 0 else "failed"), time.monotonic() - started


def wall_clock_rerun(name: str, multiple: float, patterns: list[str], skip_done: bool = False) -> dict[str, str]:
    """Rerun NAME's timed-out mutants (or those matching ``patterns``) one at a time, each in a
    fresh process under a wall-clock limit of ``multiple`` x the clean tests' wall time measured
    first, with the current tests. mutmut's workers are forked from a process that has imported
    paddle, whose thread pools can hold a lock at the fork: such a worker waits in a futex
    forever at a few % CPU, and mutmut's CPU-time limit reports a "timeout" only after many
    minutes, or never. A mutant whose tests pass survives; one whose tests fail or outrun the
    limit is killed. Results go to build/mutation/NAME/wall_clock.PID.json."""
    from mutmut.stats import status_by_exit_code

    source, tests = TARGETS[name]
    work = ROOT / "build" / "mutation" / name
    shutil.copytree(ROOT / "tests", work / "mutants" / "tests", dirs_exist_ok=True)
    codes = json.loads((work / "mutants" / (source + ".meta")).read_text())["exit_code_by_key"]
    if patterns:
        keys = [k for k in sorted(codes) if any(fnmatch.fnmatch(k, p) for p in patterns)]
    else:
        keys = [k for k in sorted(codes) if status_by_exit_code[codes[k]] == "timeout"]
    if skip_done:
        done = wall_clock_results(name)
        keys = [k for k in keys if k not in done]
    clean, seconds = _run_tests(work, tests, "", None)
    if clean != "passed":
        raise SystemExit(f"{name}: the tests fail without a mutant ({clean}); fix them first")
    limit = multiple * seconds
    print(f"{name}: clean tests {seconds:.0f} s; {len(keys)} mutants, {limit:.0f} s each at most", flush=True)
    out_path = work / f"wall_clock.{os.getpid()}.json"  # one file a run: runs may go side by side
    results: dict[str, str] = {}
    for key in keys:
        outcome, took = _run_tests(work, _tests_for(work, tests, key), key, limit)
        results[key] = {"passed": "survived", "failed": "killed", "hang": "killed (hang)"}[outcome]
        print(f"  {results[key]:14s} {took:5.0f} s  {key}", flush=True)
        out_path.write_text(json.dumps(results, indent=1))
    every = wall_clock_results(name)
    print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(Counter(every.values()).items())))
    return results


def wall_clock_results(name: str) -> dict[str, str]:
    """Every wall-clock rerun of NAME so far, the latest verdict of each mutant."""
    merged: dict[str, str] = {}
    for path in sorted((ROOT / "build" / "mutation" / name).glob("wall_clock*.json"), key=lambda p: p.stat().st_mtime):
        merged.update(json.loads(path.read_text()))
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", choices=sorted(TARGETS))
    ap.add_argument("--list", action="store_true", help="print each target's file and tests")
    ap.add_argument("--report", action="store_true", help="only print the last run's counts")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--timeout-multiplier", type=float, help="instead of pyproject.toml's (rerun timeouts)")
    ap.add_argument("--wall-clock", type=float, metavar="X", help="rerun timeouts at X x the clean wall time")
    ap.add_argument("--skip-done", action="store_true", help="with --wall-clock: leave out mutants already rerun")
    ap.add_argument("mutants", nargs="*", help="rerun only these mutant names (fnmatch patterns)")
    args = ap.parse_intermixed_args()
    if args.list or not args.name:
        for name, (source, tests) in TARGETS.items():
            print(f"{name:15s} {source}\n{'':15s} " + " ".join(tests))
        return
    if args.wall_clock:
        wall_clock_rerun(args.name, args.wall_clock, args.mutants, args.skip_done)
        return
    if not args.report:
        work = _scratch(args.name, args.timeout_multiplier)
        cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *args.mutants]
        subprocess.run(cmd, cwd=work, check=False)
    report(args.name)


if __name__ == "__main__":
    main()
