"""Runs the documentation's runnable Python examples, each in a process of its own, for tests/docs/test_docs.py.

    python tests/docs/examples_runner.py EXAMPLES.json RESULTS.json TIMEOUT_SECONDS

EXAMPLES.json is a list of {"name", "code"}. This process imports torch, Transformers and switchhead once, then
forks one child per example: the child starts with those modules loaded (seconds saved per example) but shares no
state with the other examples; it runs the code as `__main__` in a fresh empty folder of its own, with its output
captured, and is killed past the timeout. RESULTS.json maps each name to {"status", "seconds", "output"}:
status "passed", "failed" (an exception or a non-zero exit) or "timeout".
"""

import json
import os
import signal
import sys
import tempfile
import time
import traceback


def _child(code: str, name: str, folder: str, output: str) -> None:
    """In the forked process: run the example, never return."""
    status = 1
    try:
        os.chdir(folder)
        log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # the example's own failure: its traceback is the output the test shows
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run(examples: list[dict], timeout: float) -> dict:
    import torch  # noqa: F401 - loaded once here, inherited by every child
    import transformers  # noqa: F401

    import switchhead  # noqa: F401

    results = {}
    for example in examples:
        folder = tempfile.mkdtemp(prefix="switchhead-docs-example-")
        output = os.path.join(tempfile.mkdtemp(prefix="switchhead-docs-output-"), "output.txt")
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(example["code"], example["name"], folder, output)
        status = "timeout"
        while time.monotonic() - started < timeout:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = "passed" if os.waitstatus_to_exitcode(code) == 0 else "failed"
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        text = open(output, encoding="utf-8", errors="replace").read() if os.path.exists(output) else ""
        results[example["name"]] = {"status": status, "seconds": round(time.monotonic() - started, 1),
                                    "output": text[-6000:]}
    return results


if __name__ == "__main__":
    examples_path, results_path, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with open(examples_path, encoding="utf-8") as f:
        found = json.load(f)
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(run(found, timeout), f)
